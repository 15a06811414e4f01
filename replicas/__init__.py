"""replicas."""
