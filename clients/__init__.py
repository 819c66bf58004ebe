"""Client libraries for pagedserve's gRPC API (Python here; Go and Java stubs are generated from protos/)."""
