# The one image every ElasticCTR pod runs: trainers and pservers (`elastic-control role`),
# the file server, cube-server/agent/transfer, serving and the MLflow tracking server.
# Build: docker build -t elastic-ctr:0.1.0 .   (the tag plan.DEFAULT_IMAGE expects)
FROM python:3.11-slim-bookworm

ENV PYTHONDONTWRITEBYTECODE=1 \
    PYTHONUNBUFFERED=1 \
    PIP_NO_CACHE_DIR=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1

# libgomp: paddlepaddle's CPU kernels; the rest of the wheels are self-contained.
RUN apt-get update \
 && apt-get install -y --no-install-recommends libgomp1 \
 && rm -rf /var/lib/apt/lists/*

WORKDIR /opt/elastic-ctr
# Dependencies first, so code changes do not reinstall paddlepaddle.
COPY requirements.txt ./
RUN pip install -r requirements.txt
COPY setup.cfg pyproject.toml README.md ./
COPY elastic_control ./elastic_control
COPY cube ./cube
COPY client ./client
COPY ctr_foundation ./ctr_foundation
COPY examples ./examples
RUN pip install --no-deps . \
 && useradd --create-home --uid 10001 elastic \
 && mkdir -p /var/lib/elastic-ctr /var/lib/elastic-ctr-cube /srv/elastic-ctr/files /var/lib/mlflow \
 && chown -R elastic /var/lib/elastic-ctr /var/lib/elastic-ctr-cube /srv/elastic-ctr /var/lib/mlflow
USER 10001
# Every manifest sets its own command; this default just shows the CLI.
CMD ["elastic-control", "--help"]
