"""A safetensors checkpoint folder as a source: ``format`` reads and validates the headers (never the
data), ``reader.SafetensorsSource`` streams the tensors lazily from rank 0 (every rank validates the
same headers). May import ``core`` only."""
