"""User plugin modules for tests, loaded by import path as a user's would be (custom_rm_path, ...)."""
