"""A simulated vLLM replica: its HTTP server, engines and the calibrated GPU model."""
