"""The buffer service: prompt datasets, prompt leases and finished sample groups, kept in Redis."""
