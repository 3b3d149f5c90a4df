"""ElasticCTR's foundation: what every part shares and nothing else.

Layers (imports only point down)::

    elastic_control  (CLI, library API, backends, training, serving, evaluation, demo)
    client           (prediction client: library + command line)
    cube             (cube-builder, cube-server, cube-agent, cube-transfer)
    ctr_foundation   (errors, env vars, names and records, atomic writes, HTTP protocol
                      and its token check, pass format, sparse-table reader, file-server client)

``ctr_foundation`` imports none of the packages above it, and ``cube`` imports only
``ctr_foundation``: no Paddle, MLflow, training or evaluation code in the cube services.
"""

__version__ = "0.1.0"
