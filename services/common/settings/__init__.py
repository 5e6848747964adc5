"""A job's settings that more than one service reads (the rollout's, the rewards'): declared once, checked where they
are made, and owned by no service's client. The trainer's own are `services/trainer/settings/`."""
