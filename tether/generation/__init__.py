"""Engine pieces shared by the service and the reference: sampling, sequences, detokenization."""
