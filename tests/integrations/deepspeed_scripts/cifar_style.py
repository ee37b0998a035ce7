"""In the style of DeepSpeedExamples' training/cifar/cifar10_deepspeed.py (its DeepSpeed calls
as they are; synthetic 32x32 images instead of torchvision's CIFAR-10, a narrower Net, and a
short warm-up). Ported to zeroplug by its imports only.

Run as DeepSpeed's launcher runs it: ``--local_rank=<i>`` and torchrun's variables per rank.
"""
import argparse

import torch
import torch.nn as nn
import torch.nn.functional as F

import zeroplug.deepspeed as deepspeed
from zeroplug.deepspeed.accelerator import get_accelerator


def add_argument():
    parser = argparse.ArgumentParser(description="CIFAR")
    parser.add_argument("-e", "--epochs", default=2, type=int, help="number of total epochs (default: 2)")
    parser.add_argument("--local_rank", type=int, default=-1, help="local rank passed from distributed launcher")
    parser.add_argument("--log-interval", type=int, default=1, help="output logging information at a given interval")
    parser.add_argument("--dtype", default="fp32", type=str, choices=["bf16", "fp16", "fp32"],
                        help="Datatype used for training")
    parser.add_argument("--stage", default=0, type=int, choices=[0, 1, 2, 3], help="ZeRO stage for training")
    parser.add_argument("--samples", default=32, type=int, help="synthetic training images")
    parser.add_argument("--seed", default=1138, type=int)
    parser = deepspeed.add_config_arguments(parser)
    return parser.parse_args()


class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.conv1 = nn.Conv2d(3, 4, 5)
        self.pool = nn.MaxPool2d(2, 2)
        self.conv2 = nn.Conv2d(4, 8, 5)
        self.fc1 = nn.Linear(8 * 5 * 5, 32)
        self.fc2 = nn.Linear(32, 16)
        self.fc3 = nn.Linear(16, 10)

    def forward(self, x):
        x = self.pool(F.relu(self.conv1(x)))
        x = self.pool(F.relu(self.conv2(x)))
        x = x.view(-1, 8 * 5 * 5)
        x = F.relu(self.fc1(x))
        x = F.relu(self.fc2(x))
        return self.fc3(x)


def synthetic_cifar(samples):
    g = torch.Generator().manual_seed(0)
    images = torch.randn(samples, 3, 32, 32, generator=g)
    labels = torch.randint(0, 10, (samples,), generator=g)
    return torch.utils.data.TensorDataset(images, labels)


def get_ds_config(args):
    """Get the DeepSpeed configuration dictionary."""
    return {
        "train_batch_size": 8,
        "steps_per_print": 2000,
        "optimizer": {"type": "Adam", "params": {"lr": 0.01, "betas": [0.8, 0.999], "eps": 1e-8,
                                                 "weight_decay": 3e-7}},
        "scheduler": {"type": "WarmupLR", "params": {"warmup_min_lr": 0, "warmup_max_lr": 0.01,
                                                     "warmup_num_steps": 4}},
        "gradient_clipping": 1.0,
        "prescale_gradients": False,
        "bf16": {"enabled": args.dtype == "bf16"},
        "fp16": {"enabled": args.dtype == "fp16", "fp16_master_weights_and_grads": False, "loss_scale": 0,
                 "loss_scale_window": 500, "hysteresis": 2, "min_loss_scale": 1, "initial_scale_power": 15},
        "wall_clock_breakdown": False,
        "zero_optimization": {"stage": args.stage, "allgather_partitions": True, "reduce_scatter": True,
                              "allgather_bucket_size": 50000000, "reduce_bucket_size": 50000000,
                              "overlap_comm": True, "contiguous_gradients": True, "cpu_offload": False},
    }


def main(args):
    # Initialize DeepSpeed distributed backend.
    deepspeed.init_distributed()
    torch.manual_seed(args.seed)
    trainset = synthetic_cifar(args.samples)
    net = Net()
    # Get list of parameters that require gradients.
    parameters = filter(lambda p: p.requires_grad, net.parameters())
    ds_config = get_ds_config(args)
    # Initialize DeepSpeed to use the following features.
    #   1) Distributed model.
    #   2) Distributed data loader.
    #   3) DeepSpeed optimizer.
    model_engine, optimizer, trainloader, __ = deepspeed.initialize(
        args=args, model=net, model_parameters=parameters, training_data=trainset, config=ds_config)
    # Get the local device name (str) and local rank (int).
    local_device = get_accelerator().device_name(model_engine.local_rank)
    local_rank = model_engine.local_rank
    # For float32, target_dtype will be None so no datatype conversion needed.
    target_dtype = None
    if model_engine.bfloat16_enabled():
        target_dtype = torch.bfloat16
    elif model_engine.fp16_enabled():
        target_dtype = torch.half
    criterion = nn.CrossEntropyLoss()
    for epoch in range(args.epochs):  # loop over the dataset multiple times
        running_loss = 0.0
        for i, data in enumerate(trainloader):
            # Get the inputs. ``data`` is a list of [inputs, labels].
            inputs, labels = data[0].to(local_device), data[1].to(local_device)
            # Try to convert to target_dtype if needed.
            if target_dtype is not None:
                inputs = inputs.to(target_dtype)
            outputs = model_engine(inputs)
            loss = criterion(outputs, labels)
            model_engine.backward(loss)
            model_engine.step()
            # Print statistics
            running_loss += loss.item()
            if local_rank == 0 and i % args.log_interval == (args.log_interval - 1):
                print(f"[{epoch + 1 : d}, {i + 1 : 5d}] loss: {running_loss / args.log_interval : .8f}")
                running_loss = 0.0
    print("Finished Training")
    # Test the network on the training images (no held-out set here).
    correct, total = 0, 0
    model_engine.eval()
    with torch.no_grad():
        for data in trainloader:
            images, labels = data[0].to(local_device), data[1].to(local_device)
            if target_dtype is not None:
                images = images.to(target_dtype)
            outputs = model_engine(images)
            _, predicted = torch.max(outputs.data, 1)
            total += labels.size(0)
            correct += (predicted == labels).sum().item()
    if local_rank == 0:
        print(f"Accuracy of the network on the {total} train images: {100 * correct / total : .0f} %")


if __name__ == "__main__":
    args = add_argument()
    main(args)
