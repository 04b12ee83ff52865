"""Training steps on a 1-process gloo group: torch DDP over a Megatron-core MLP (its tensor-parallel
linear layers and activation; the layer's attention needs CUDA for its memory buffer, even on CPU)."""
import os, sys
import torch, torch.distributed as dist

os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=sys.argv[2])
dist.init_process_group("gloo", rank=0, world_size=1)
torch.manual_seed(0)
variant = sys.argv[1]
layer = None
try:
    from megatron.core import parallel_state
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
    from megatron.core.tensor_parallel.random import model_parallel_cuda_manual_seed
    from megatron.core.transformer.transformer_config import TransformerConfig
    from megatron.core.transformer.transformer_layer import TransformerLayer

    parallel_state.initialize_model_parallel()
    config = TransformerConfig(num_layers=1, hidden_size=32, num_attention_heads=4, use_cpu_initialization=True,
                               bias_dropout_fusion=False, gradient_accumulation_fusion=False)
    layer = TransformerLayer(config, get_gpt_layer_local_spec().submodules).mlp
    print("megatron MLP built", flush=True)
except Exception as exc:  # megatron-core's layer may need CUDA in some versions
    print(f"megatron layer not built on CPU: {type(exc).__name__}: {exc}", flush=True)
    layer = torch.nn.TransformerEncoderLayer(32, 4, 64, dropout=0.0, batch_first=False)
model = torch.nn.parallel.DistributedDataParallel(layer)
opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
hidden = torch.randn(8, 2, 32)  # [seq, batch, hidden]
for step in range(3):
    out = model(hidden)
    if isinstance(out, tuple):  # Megatron's MLP returns (output, bias) for a fused bias add
        out = out[0] + out[1] if out[1] is not None else out[0]
    act = torch.tanh(out)                   # saves its result
    if variant == "bug" and step == 1:
        act[0].zero_()                      # a "mask the first token" written in place
    loss = act.pow(2).mean()
    loss.backward()
    opt.step()
    opt.zero_grad()
print("steps ok", flush=True)
dist.destroy_process_group()
