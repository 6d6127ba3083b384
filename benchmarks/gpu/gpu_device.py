"""Which device a rank of the GPU check's jobs trains on (benchmarks/gpu_check.py).

The GPU variants of the examples call :func:`pick_device` first thing, where a torchrun
script calls ``torch.cuda.set_device(LOCAL_RANK)``. ``device="cpu"`` (the check's ``--dry``
mode) changes nothing. For ``"cuda"`` the check says, through the job's environment, how the
ranks share the machine's GPUs:

* ``HOTSPARE_GPU_CHECK_DEVICES`` unset: every rank on ``cuda:0`` (the job runs with
  ``CUDA_VISIBLE_DEVICES=0``).
* ``HOTSPARE_GPU_CHECK_DEVICES=0,1``: rank ``r`` on ``cuda:<list[r % n]>`` (a spare taking
  rank ``r`` over gets the dead rank's device).
* ``HOTSPARE_GPU_CHECK_DEVICES=MIG-...,MIG-...``: rank ``r`` sees only its MIG instance
  (``CUDA_VISIBLE_DEVICES`` is set here, before CUDA is initialised in this process; the job
  runs with ``PYTORCH_NVML_BASED_CUDA_CHECK=1`` so that hotspare's ``is_available()`` does not
  initialise it earlier).
* ``HOTSPARE_GPU_CHECK_HOSTID=1``: each rank gets its own ``NCCL_HOSTID``, so that NCCL,
  which refuses two ranks of one communicator on one GPU ("Duplicate GPU detected"), takes
  them for ranks on different hosts and connects them over loopback sockets.
"""

from __future__ import annotations

import os

import torch
import torch.distributed as dist


def pick_device(device: str) -> torch.device:
    rank = dist.get_rank()
    if device == "cpu":
        print(f"gpu_check: rank {rank} trains on cpu, backend {dist.get_backend()}", flush=True)
        return torch.device("cpu")
    if os.environ.get("HOTSPARE_GPU_CHECK_HOSTID"):
        os.environ["NCCL_HOSTID"] = f"hotspare-gpu-check-rank{rank}"  # read at the communicator's init
    devices = [d for d in os.environ.get("HOTSPARE_GPU_CHECK_DEVICES", "").split(",") if d]
    index = 0
    if devices:
        mine = devices[rank % len(devices)]
        if mine.isdigit():
            index = int(mine)
        elif torch.cuda.is_initialized():
            raise RuntimeError(f"rank {rank}: CUDA is already initialised in this worker, so it cannot be given "
                               f"the device {mine} through CUDA_VISIBLE_DEVICES")
        else:
            os.environ["CUDA_VISIBLE_DEVICES"] = mine
    torch.cuda.set_device(index)
    dev = torch.device("cuda", index)
    print(f"gpu_check: rank {rank} trains on {dev} ({torch.cuda.get_device_name(dev)}), "
          f"backend {dist.get_backend()}", flush=True)
    return dev
