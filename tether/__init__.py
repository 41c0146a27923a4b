"""tether: pipeline-parallel LLM serving over gRPC in which every activation stays tethered to its request."""

__version__ = "0.1.0"
