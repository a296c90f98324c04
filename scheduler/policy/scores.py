"""Scores 0..100 for devices that passed the filters; higher is better."""

from __future__ import annotations

from scheduler.policy.types import MAX_SPEED, DeviceView, PlacementRequest

# Rough samples/s per CPU core of a mid-range phone per arch, used until the agent has profiled
# the model (a spec-based estimate: only the ranking between devices matters).
EST_SAMPLES_PER_CORE = {"logreg": 20000.0, "mlp": 4000.0, "cnn": 400.0, "resnet": 20.0,
                        "mobilenet_v1": 8.0}
DEFAULT_SAMPLES_PER_CORE = 100.0
WEIGHTS = {"speed": 60.0, "thermal": 25.0, "battery": 15.0}


def device_speed(device: DeviceView, arch: str) -> float:
    """Measured samples/s for this arch, else an estimate from the core count: always a finite
    number in (0, MAX_SPEED] (a measured speed that is not one counts as not measured)."""
    measured = device.speeds.get(arch)
    if isinstance(measured, (int, float)) and 0 < measured <= MAX_SPEED:  # False for NaN
        return float(measured)
    cores = device.cpu_cores if isinstance(device.cpu_cores, int) else 1
    return EST_SAMPLES_PER_CORE.get(arch, DEFAULT_SAMPLES_PER_CORE) * min(max(1, cores), 1024)


def speed_score(device: DeviceView, req: PlacementRequest, fastest: float) -> float:
    return 100.0 * device_speed(device, req.arch) / fastest if fastest > 0 else 0.0


def thermal_score(device: DeviceView, req: PlacementRequest) -> float:
    """Headroom below the job's limit; 20 C of headroom or more counts as full."""
    if device.temp_c is None:
        return 50.0
    return 100.0 * min(1.0, max(0.0, (req.max_temp_c - device.temp_c) / 20.0))


def battery_score(device: DeviceView, req: PlacementRequest) -> float:
    if device.charging:
        return 100.0
    if device.battery_pct is None:
        return 50.0
    return max(0.0, min(100.0, device.battery_pct))


def score(device: DeviceView, req: PlacementRequest, fastest: float) -> float:
    parts = {
        "speed": speed_score(device, req, fastest),
        "thermal": thermal_score(device, req),
        "battery": battery_score(device, req),
    }
    return sum(WEIGHTS[name] * value for name, value in parts.items()) / sum(WEIGHTS.values())
