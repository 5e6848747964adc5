"""The weight broadcast from the trainer to the engines, and the weight snapshots on disk."""
