# The one image every ElasticCTR pod runs: trainers and pservers (`elastic-control role`),
# the file server, cube-server/agent/transfer, serving and the MLflow tracking server.
#
#   docker build -t REGISTRY/elastic-ctr:0.1.0 .                                # s3:// data (s3fs)
#   docker build --build-arg HADOOP_VERSION=3.3.6 -t REGISTRY/elastic-ctr:0.1.0-hdfs .   # + hdfs:// data
#
# then `elastic-control -r --image REGISTRY/elastic-ctr:0.1.0 ...` (push it where the nodes pull from).
# The pods run it as uid 10001 under Pod Security "restricted" (docs/contracts.md, "Kubernetes").
FROM python:3.11-slim-bookworm

# Empty: no HDFS client. A Hadoop release (e.g. 3.3.6) adds a Java runtime and Hadoop's libhdfs, which
# pyarrow's HadoopFileSystem (fsspec's hdfs://) loads.
ARG HADOOP_VERSION=""
ARG HADOOP_MIRROR=https://archive.apache.org/dist/hadoop/common

ENV PYTHONDONTWRITEBYTECODE=1 \
    PYTHONUNBUFFERED=1 \
    PIP_NO_CACHE_DIR=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1

# libgomp: paddlepaddle's CPU kernels; the rest of the wheels are self-contained.
RUN apt-get update \
 && apt-get install -y --no-install-recommends libgomp1 \
 && if [ -n "$HADOOP_VERSION" ]; then apt-get install -y --no-install-recommends openjdk-17-jre-headless curl; fi \
 && rm -rf /var/lib/apt/lists/*

# HDFS: Hadoop's native libhdfs and jars. libhdfs starts its JVM through JNI, which does not expand
# CLASSPATH wildcards, so the jars are listed in the manifest of one "pathing" jar that CLASSPATH names.
ENV HADOOP_HOME=/opt/hadoop \
    ARROW_LIBHDFS_DIR=/opt/hadoop/lib/native \
    JAVA_HOME=/usr/lib/jvm/java-17-openjdk-amd64 \
    CLASSPATH=/opt/hadoop/pathing.jar
RUN if [ -n "$HADOOP_VERSION" ]; then \
      curl -fsSL "$HADOOP_MIRROR/hadoop-$HADOOP_VERSION/hadoop-$HADOOP_VERSION.tar.gz" -o /tmp/hadoop.tgz \
   && curl -fsSL "$HADOOP_MIRROR/hadoop-$HADOOP_VERSION/hadoop-$HADOOP_VERSION.tar.gz.sha512" -o /tmp/hadoop.sha512 \
   && test "$(sha512sum /tmp/hadoop.tgz | cut -d' ' -f1)" = "$(grep -oE '[0-9a-f]{128}' /tmp/hadoop.sha512)" \
   && mkdir -p /opt/hadoop && tar -xzf /tmp/hadoop.tgz -C /opt/hadoop --strip-components=1 \
   && rm -rf /tmp/hadoop.tgz /tmp/hadoop.sha512 /opt/hadoop/share/doc \
   && python -c "import glob, zipfile; jars = sorted(glob.glob('/opt/hadoop/share/hadoop/*/*.jar') + glob.glob('/opt/hadoop/share/hadoop/*/lib/*.jar')); line = 'Class-Path: ' + ' '.join('file:' + j for j in jars); wrapped = '\r\n '.join(line[i:i + 70] for i in range(0, len(line), 70)); zipfile.ZipFile('/opt/hadoop/pathing.jar', 'w').writestr('META-INF/MANIFEST.MF', 'Manifest-Version: 1.0\r\n' + wrapped + '\r\n\r\n')"; \
    fi

WORKDIR /opt/elastic-ctr
# Dependencies first, so code changes do not reinstall paddlepaddle. requirements.txt carries s3fs.
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
