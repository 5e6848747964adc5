"""A job's settings, one module per part (driver, rollout, rewards, weight sync, slime hooks): declared once, checked
where they are made, and owned by no service's client, so every service and the trainer import them from here."""
