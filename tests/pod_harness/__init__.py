"""Run the manifests `elastic-control -r --backend k8s` renders as a one-node cluster would, with no image.

See cluster.py for what is emulated (and what is not). Needs root, iproute2 and
util-linux; ``network.missing_requirements()`` says why not, for a clear skip.
"""
