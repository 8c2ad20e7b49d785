//! rackfill-models: Hugging Face MoE checkpoints (config.json, safetensors, tokenizer, chat
//! template) loaded offline, with each family split into attention, router and per-expert FFN so
//! that experts can run on any rank. Nothing is implemented yet.
