"""The Reward service: stateless scorers (built-in verifiers and user functions by import path), gRPC and REST."""
