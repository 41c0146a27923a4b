"""Generated protobuf/gRPC code for protos/tether/v1 (built by `make proto`, not committed)."""
