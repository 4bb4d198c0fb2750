"""Adapter storage: S3 and local-directory backends behind one interface."""
