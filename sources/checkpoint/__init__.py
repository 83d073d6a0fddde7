"""``SafetensorsSource``: a safetensors checkpoint folder read back as a source (rank 0 reads,
every rank validates the same headers)."""
