"""Tests of the cache initializer (images/initializer) against a strict in-memory Kubernetes API."""
