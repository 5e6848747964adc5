"""Helm chart tests: lint, render, schema and guards, Kubernetes schemas, GPU-cluster conventions."""
