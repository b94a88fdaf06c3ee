# PyTorch beside tests/pipeline/pipeline.rs::stages_built_on_threads_at_once_start_from_the_same_values
# (python3 scripts/rng_threads.py): four threads seed and draw from PyTorch's one default CPU generator at
# once, as seeded model builds on four threads. How often does a build get other values than one alone?
import threading, torch
def build():
    out = []
    for i in range(5):
        torch.manual_seed(42 + i)
        out.append(torch.nn.Linear(16, 16).weight.detach().clone())
    return out
alone = build()
bad = [0]
def worker():
    for _ in range(100):
        got = build()
        if any(not torch.equal(a, b) for a, b in zip(alone, got)):
            bad[0] += 1
ts = [threading.Thread(target=worker) for _ in range(4)]
[t.start() for t in ts]; [t.join() for t in ts]
print(f"pytorch: {bad[0]} of 400 builds on 4 threads differ from a build alone (torch {torch.__version__})")
