"""`phalanx demo`: the embedded control plane, a simulated fleet running the real agent, a real job."""
