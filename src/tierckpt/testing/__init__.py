"""Real parts on loopback for the tests, the benchmarks and the demo: ``s3_server`` (a local
SeaweedFS S3 server), ``twonode`` (two ``tierckpt run`` or torchrun agents on 127.0.0.1) and
``storecount`` (a store that counts its operations), ``files`` (a dataset of one file per
sample on disk). Nothing in the library imports them."""
