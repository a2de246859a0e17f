# mingpt for cloud GPU instances. Build:  docker build -t mingpt .
# Two instances, same command on each (see README, "Multi-node"):
#   docker run --gpus all --network host --ipc host -e AWS_ACCESS_KEY_ID -e AWS_SECRET_ACCESS_KEY -e AWS_DEFAULT_REGION \
#     mingpt --nnodes=2 --nproc_per_node=gpu --rdzv_backend=c10d --rdzv_endpoint=HOST1:29500 --rdzv_id=run1 \
#     --rdzv_conf=last_call_timeout=1,keep_alive_interval=1,keep_alive_max_attempt=3,read_timeout=10 --max-restarts=3 \
#     -m mingpt.main trainer.run_dir=runs/run1 snapshot=s3 snapshot.dir=s3://my-bucket/mingpt/run1
# The same torch as pyproject's floor (tests/test_docker.py checks that they agree): pip installs no other.
FROM pytorch/pytorch:2.12.0-cuda12.6-cudnn9-runtime

ENV PYTHONUNBUFFERED=1 \
    PIP_NO_CACHE_DIR=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1 \
    # torch's shared rendezvous store makes repeated worker restarts flaky
    TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1 \
    # fail a hung NCCL collective instead of waiting forever; log only warnings by default
    TORCH_NCCL_ASYNC_ERROR_HANDLING=1 \
    NCCL_DEBUG=WARN

WORKDIR /opt/mingpt
COPY pyproject.toml README.md ./
COPY conf ./conf
COPY mingpt ./mingpt
# Non-editable: the image needs no source tree; conf/ (linked as mingpt/conf) is installed inside the package. The formats
# extra reads Parquet and zstd JSON lines in mingpt-prepare (the project itself: nothing to pin).
# hadolint ignore=DL3013
RUN pip install --no-cache-dir ".[formats]" && rm -rf /opt/mingpt/build

RUN groupadd --gid 1000 mingpt && useradd --create-home --uid 1000 --gid 1000 mingpt
USER 1000:1000
WORKDIR /home/mingpt

ENTRYPOINT ["torchrun"]
CMD ["--standalone", "--nproc_per_node=gpu", "-m", "mingpt.main"]
