"""Benchmarks run by ``tierckpt bench``: each module measures one thing against its anchors."""
