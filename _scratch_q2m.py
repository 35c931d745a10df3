import torch, transformers as T
from qlens.bridge import Bridge
torch.manual_seed(0)
c=T.Qwen2MoeConfig(vocab_size=100,hidden_size=32,num_hidden_layers=3,num_attention_heads=2,num_key_value_heads=1,intermediate_size=48,moe_intermediate_size=16,shared_expert_intermediate_size=24,num_experts=4,num_experts_per_tok=2,mlp_only_layers=[1],max_position_embeddings=64)
m=T.AutoModelForCausalLM.from_config(c).eval()
print(type(m.model.layers[0].mlp.experts))
b=Bridge(m)
t=torch.tensor([[1,2,3,4,5]])
with torch.no_grad():
  l,cache=b.run_with_cache(t)
  r=m(t,output_hidden_states=True)
print((l-r.logits).abs().max())
print([n for n in b.hook_names if "blocks.0" in n])
print(b.cfg)
