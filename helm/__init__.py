"""The Helm chart (helm/pagedserve/) and its generator (`python -m helm.generate`)."""
