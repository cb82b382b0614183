import json, sys, torch
from lathe.models import ssd
torch.manual_seed(0)
dev = "cuda"
H, P, G, N = 64, 64, 8, 128
lengths = [1, 64, 300, 777]
T = sum(lengths)
cu = torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()], device=dev, dtype=torch.int32)
x = torch.randn(T, H, P, device=dev, dtype=torch.bfloat16)
B = (torch.randn(T, G, N, device=dev) / N ** 0.5).bfloat16()
C = (torch.randn(T, G, N, device=dev) / N ** 0.5).bfloat16()
dt = torch.nn.functional.softplus(torch.randn(T, H, device=dev) - 2)
A = -torch.rand(H, device=dev).mul(4).add(0.5)
D = torch.randn(H, device=dev)
h0 = torch.randn(len(lengths), H, P, N, device=dev)
out = {}
with torch.inference_mode():
    for name, init in (("zero", None), ("h0", h0)):
        assert ssd._fla_takes(x, dt, A, B, C, init)
        y, f = ssd._fla_scan(x, dt, A, B, C, cu, D, init)
        yw, fw = ssd.torch_scan(x.float(), dt, A, B.float(), C.float(), cu, max(lengths), D=D, initial_state=init)
        out[name] = {"y": float((y.float() - yw).norm() / yw.norm()), "final": float((f - fw).norm() / fw.norm())}
        print(name, out[name], flush=True)
json.dump(out, open(sys.argv[1], "w"))
