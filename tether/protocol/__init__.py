"""The tethered protocol: context hash chain, stamp checks and the activation tensor codec."""
