# mingpt for cloud GPU instances. Build:  docker build -t mingpt .
# Two instances, the same command on each (docs/multi-node.md, "Docker"). Every container runs as the image's
# user, uid 1000, which must own the volume; the job's secret is the same on both, passed by name from the
# shell (-e NAME: never its value on a command line):
#   sudo install -d -o 1000 -g 1000 /data/mingpt   # once per instance
#   export MINGPT_JOB_SECRET=...   # once per job, random: openssl rand -hex 32
#   docker run --gpus all --network host --ipc host --stop-timeout 300 \
#     -v /data/mingpt:/data/mingpt -e HOME=/data/mingpt -e MINGPT_JOB_SECRET \
#     -e AWS_ACCESS_KEY_ID -e AWS_SECRET_ACCESS_KEY -e AWS_DEFAULT_REGION \
#     mingpt --nnodes=1:2 --nproc_per_node=gpu --rdzv_backend=mingpt --rdzv_endpoint=HOST1:29500 --rdzv_id=run2 \
#     --rdzv_conf=last_call_timeout=1,keep_alive_interval=1,keep_alive_max_attempt=3,read_timeout=10 --max-restarts=3 \
#     --shutdown-timeout=270 -m mingpt.main trainer.run_dir=/data/mingpt/runs/run2 snapshot=s3 \
#     snapshot.dir=s3://my-bucket/mingpt/run2 snapshot.node_cache_dir=/dev/shm/run2
# tests/test_image.py builds this file and runs this command in podman (on a local CPU base, without --gpus).
# The same torch as pyproject's floor (tests/test_docker.py checks that they agree): pip installs no other.
# The base is a build argument only so that tests/test_image.py can build this file on a local base
# (Debian's Python and the torch CPU wheel): users build on the default.
ARG BASE=pytorch/pytorch:2.12.0-cuda12.6-cudnn9-runtime
FROM ${BASE}

ENV PYTHONUNBUFFERED=1 \
    PIP_NO_CACHE_DIR=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1 \
    # fail a hung NCCL collective instead of waiting forever; log only warnings by default
    TORCH_NCCL_ASYNC_ERROR_HANDLING=1 \
    NCCL_DEBUG=WARN

WORKDIR /opt/mingpt
COPY pyproject.toml README.md ./
COPY conf ./conf
COPY mingpt ./mingpt
# Non-editable: the image needs no source tree; conf/ (linked as mingpt/conf) is installed inside the package. The formats
# extra reads Parquet and zstd JSON lines in mingpt-prepare, boto3 serves snapshot.uploader=boto3 (the project
# itself: nothing to pin).
# hadolint ignore=DL3013
RUN pip install --no-cache-dir ".[formats,boto3]" && rm -rf /opt/mingpt/build

RUN groupadd --gid 1000 mingpt && useradd --create-home --uid 1000 --gid 1000 mingpt
USER 1000:1000
WORKDIR /home/mingpt

# torchrun with the job-private rendezvous, the workers' exit codes and no retry of a bad setting
ENTRYPOINT ["mingpt-torchrun"]
CMD ["--standalone", "--nproc_per_node=gpu", "-m", "mingpt.main"]
