"""The file server: carries configs, dense models and cube shards between components.

``PUT``/``GET``/``DELETE /files/PATH``, directory listings, atomic streamed
writes with sha256, a size limit, a bearer token for writes, and no path that
escapes the root. See docs/contracts.md ("File server").
"""
