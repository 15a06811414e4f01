"""OpenAI's Batch API on the fleet: uploaded JSONL files, batches of requests run through the
gateway's own request path in the ``batch`` band, their output and error files (docs/batch.md)."""
