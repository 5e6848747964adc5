"""The weights the engines hold (their version, pushed after training, announced to a manager that restarted), their
broadcast from the trainer to the engines, and the weight snapshots on disk."""
