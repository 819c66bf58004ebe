"""pagedserve gRPC contracts: the .proto sources and the Python code generated from them."""
