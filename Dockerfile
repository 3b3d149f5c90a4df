# The one image every ElasticCTR pod runs: trainers and pservers (`elastic-control role`),
# the file server, cube-server/agent/transfer, serving and the MLflow tracking server.
#
#   docker build -t REGISTRY/elastic-ctr:0.1.0 .                                          # s3:// data
#   docker build --build-arg HADOOP_VERSION=3.3.6 -t REGISTRY/elastic-ctr:0.1.0-hdfs .   # + hdfs:// data
#
# or scripts/build-image.sh (podman; bootstraps the base when no registry is reachable). Then
# `elastic-control -r --image REGISTRY/elastic-ctr:0.1.0 ...` (push it where the nodes pull from).
# The pods run it as uid 10001 under Pod Security "restricted" (docs/contracts.md, "Kubernetes").
#
# Stages: `deps` (a virtual environment with the runtime dependencies), `hadoop` (the optional HDFS
# client), `app` (ElasticCTR itself) and the final image, which copies their results onto a clean
# base: no pip, no build tools, no package lists, no download left in it.
#
# BASE: Debian bookworm with Python 3.11 and `python3 -m venv` (scripts/build-image.sh passes an
# mmdebstrap-built one when no registry is reachable). An HTTPS-intercepting proxy's CA bundle may be
# passed as the build secret `ca-bundle` (--secret id=ca-bundle,src=...): it is mounted for the
# downloads only and never lands in a layer.
ARG BASE=python:3.11-slim-bookworm

FROM ${BASE} AS deps
ENV PIP_NO_CACHE_DIR=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1 \
    PYTHONDONTWRITEBYTECODE=1 \
    LANG=C.UTF-8
COPY requirements.txt /tmp/requirements.txt
# mlflow declares scikit-learn, scipy and skops for its model flavors; the tracking server and the
# client calls ElasticCTR makes import none of them, and scikit-learn is a test-only package here
# (tests/test_image.py checks it is absent). pip, the C headers and the packages' own test suites
# (pandas' alone is 40 MB) leave the environment too; setuptools stays (`import paddle` imports it).
RUN --mount=type=secret,id=ca-bundle \
    if [ -s /run/secrets/ca-bundle ]; then export PIP_CERT=/run/secrets/ca-bundle; fi \
 && python3 -m venv /opt/venv \
 && /opt/venv/bin/python -m pip install -q -r /tmp/requirements.txt \
 && /opt/venv/bin/python -m pip uninstall -q -y scikit-learn scipy skops joblib threadpoolctl \
 && /opt/venv/bin/python -m pip uninstall -q -y pip \
 && cd /opt/venv/lib/python3*/site-packages \
 && rm -rf pyarrow/include paddle/include \
 && find . -depth -type d -name tests -exec rm -rf {} +

# HDFS: Hadoop's native libhdfs and jars (empty without HADOOP_VERSION). libhdfs starts its JVM
# through JNI, which does not expand CLASSPATH wildcards, so the jars are listed in the manifest of
# one "pathing" jar that CLASSPATH names. YARN, MapReduce and the tools are left out (the HDFS
# client needs hadoop-common and hadoop-hdfs-client).
FROM ${BASE} AS hadoop
ARG HADOOP_VERSION=""
ARG HADOOP_MIRROR=https://archive.apache.org/dist/hadoop/common
RUN --mount=type=secret,id=ca-bundle \
    mkdir -p /opt/hadoop \
 && if [ -n "$HADOOP_VERSION" ]; then \
      if [ -s /run/secrets/ca-bundle ]; then export SSL_CERT_FILE=/run/secrets/ca-bundle; fi \
   && url="$HADOOP_MIRROR/hadoop-$HADOOP_VERSION/hadoop-$HADOOP_VERSION.tar.gz" \
   && python3 -c "import sys, urllib.request; [urllib.request.urlretrieve(u, f) for u, f in zip(sys.argv[1::2], sys.argv[2::2])]" \
        "$url" /tmp/hadoop.tgz "$url.sha512" /tmp/hadoop.sha512 \
   && test "$(sha512sum /tmp/hadoop.tgz | cut -d' ' -f1)" = "$(grep -oE '[0-9a-f]{128}' /tmp/hadoop.sha512)" \
   && tar -xzf /tmp/hadoop.tgz -C /opt/hadoop --strip-components=1 \
   && rm -rf /tmp/hadoop.tgz /tmp/hadoop.sha512 /opt/hadoop/share/doc /opt/hadoop/share/hadoop/yarn \
        /opt/hadoop/share/hadoop/mapreduce /opt/hadoop/share/hadoop/tools /opt/hadoop/include \
        /opt/hadoop/sbin /opt/hadoop/libexec/shellprofile.d \
   && python3 -c "import glob, zipfile; jars = sorted(glob.glob('/opt/hadoop/share/hadoop/*/*.jar') + glob.glob('/opt/hadoop/share/hadoop/*/lib/*.jar')); line = 'Class-Path: ' + ' '.join('file:' + j for j in jars); wrapped = '\r\n '.join(line[i:i + 70] for i in range(0, len(line), 70)); zipfile.ZipFile('/opt/hadoop/pathing.jar', 'w').writestr('META-INF/MANIFEST.MF', 'Manifest-Version: 1.0\r\n' + wrapped + '\r\n\r\n')"; \
    fi

# ElasticCTR itself, installed into the environment by a throwaway pip; only the files it adds (its
# RECORD: packages, package data, console scripts) go on to the final image, so a code change
# rebuilds a few megabytes, not the dependencies.
FROM deps AS app
COPY . /src
RUN --mount=type=secret,id=ca-bundle \
    if [ -s /run/secrets/ca-bundle ]; then export PIP_CERT=/run/secrets/ca-bundle; fi \
 && python3 -m venv /opt/tools \
 && /opt/tools/bin/python -m pip install -q --upgrade pip setuptools wheel \
 && /opt/tools/bin/python -m pip wheel -q --no-deps --no-build-isolation --wheel-dir /tmp/wheels /src \
 && /opt/tools/bin/python -m pip --python /opt/venv/bin/python install -q --no-deps /tmp/wheels/*.whl \
 && /opt/venv/bin/python -c "import sys; from importlib.metadata import distribution; d = distribution('elastic-ctr'); print('\n'.join(str(d.locate_file(f).resolve()) for f in d.files))" \
      | { mkdir -p /staging && while read -r f; do if [ -e "$f" ]; then cp -a --parents "$f" /staging; fi; done; } \
 && test -x /staging/opt/venv/bin/elastic-control

FROM ${BASE}
ARG HADOOP_VERSION=""
LABEL org.opencontainers.image.title="elastic-ctr" \
      org.opencontainers.image.source="https://github.com/PaddlePaddle/ElasticCTR"
# NUMBA_CACHE_DIR: where the compiled kernels (ctr_foundation/compiled.py) keep their machine code; the
# pods' site-packages and home are read-only, /tmp is theirs. ELASTIC_CTR_NUMBA_SEED: the same kernels
# compiled when the image is built (below), which a pod's first kernel copies into its NUMBA_CACHE_DIR:
# 0.7 s of CPU to load them all against 13.5 s to compile them (the reader's parse 3.6 s of it).
ENV PATH=/opt/venv/bin:$PATH \
    PYTHONDONTWRITEBYTECODE=1 \
    PYTHONUNBUFFERED=1 \
    LANG=C.UTF-8 \
    MPLCONFIGDIR=/tmp/matplotlib \
    NUMBA_CACHE_DIR=/tmp/numba \
    ELASTIC_CTR_NUMBA_SEED=/opt/elastic-ctr/numba-seed \
    HADOOP_HOME=/opt/hadoop \
    ARROW_LIBHDFS_DIR=/opt/hadoop/lib/native \
    JAVA_HOME=/usr/lib/jvm/java-17-openjdk-amd64 \
    CLASSPATH=/opt/hadoop/pathing.jar
# libgomp: paddlepaddle's CPU kernels (the other wheels are self-contained); a Java runtime for HDFS.
# The writable folders are where the pods mount their volumes.
RUN apt-get update -qq \
 && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends libgomp1 \
      $(if [ -n "$HADOOP_VERSION" ]; then echo openjdk-17-jre-headless; fi) >/dev/null \
 && rm -rf /var/lib/apt/lists/* /var/cache/apt/*.bin /var/log/apt /var/log/dpkg.log \
 && groupadd --gid 10001 elastic \
 && useradd --uid 10001 --gid 10001 --create-home --shell /bin/sh elastic \
 && mkdir -p /var/lib/elastic-ctr /var/lib/elastic-ctr-cube /srv/elastic-ctr/files /var/lib/mlflow \
 && chown -R 10001:10001 /var/lib/elastic-ctr /var/lib/elastic-ctr-cube /srv/elastic-ctr /var/lib/mlflow
COPY --from=deps /opt/venv /opt/venv
COPY --from=hadoop /opt/hadoop /opt/hadoop
COPY --from=app /staging/ /
# Compiled here, against the installed files themselves (numba keys its cache to each file's path, size and
# time); a node whose CPU differs from the build host's compiles its own, as without the seed.
RUN NUMBA_CACHE_DIR=/opt/elastic-ctr/numba-seed python -m elastic_control.kube.kernel_cache /opt/elastic-ctr/numba-seed \
 && chmod -R a+rX /opt/elastic-ctr/numba-seed
WORKDIR /opt/elastic-ctr
USER 10001:10001
# Every manifest sets its own command; this default just shows the CLI.
CMD ["elastic-control", "--help"]
