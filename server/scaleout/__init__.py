"""Trellis as Ray Serve replicas (``trellis serve --ray``).

- ``keys``: the cache-affinity key of a request (no Ray needed).
- ``router``: a Ray Serve ``RequestRouter`` that sends a key to the replica most likely to hold it.
- ``replica``: the engine deployment, each replica running today's single-server app in-process.
- ``entry``: the HTTP entry point (a plain ASGI app behind ``serve.ingress``) that forwards to replicas,
  retries requests that had not started, and aggregates ``/metrics``.
- ``launch``: start or join a Ray cluster and deploy both (the ``--ray`` branch of the CLI).

Ray is an optional extra (``pip install "trellis-server[ray]"``): nothing here is imported by the core
server, and only ``launch``, ``router``, ``replica`` and ``entry`` import Ray.
"""
