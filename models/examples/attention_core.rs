//! Times the causal attention core alone (16 query heads, 4 KV heads of 64, random inputs) for
//! one prompt length: best of 5 after a warm-up. The figures in docs/performance.md come from
//! `RAYON_NUM_THREADS=1 cargo run --release -p rackfill-models --example attention_core -- 4096`.

use candle_core::{Device, Tensor};
use rackfill_models::layers::attention::causal_attention;

fn main() -> Result<(), Box<dyn std::error::Error>> {
    let tokens: usize = match std::env::args().nth(1) {
        Some(arg) => arg.parse().map_err(|e| format!("tokens `{arg}`: {e}"))?,
        None => 4096,
    };
    let (heads, kv_heads, dim) = (16, 4, 64);
    let random = |heads: usize| Tensor::randn(0f32, 1.0, (heads, tokens, dim), &Device::Cpu);
    let (q, k, v) = (random(heads)?, random(kv_heads)?, random(kv_heads)?);
    let scale = 1.0 / (dim as f64).sqrt();
    causal_attention(&q, &k, &v, scale)?;
    let mut best = f64::MAX;
    for _ in 0..5 {
        let started = std::time::Instant::now();
        causal_attention(&q, &k, &v, scale)?;
        best = best.min(started.elapsed().as_secs_f64());
    }
    println!("{tokens} tokens: best {:.1} ms", best * 1e3);
    Ok(())
}
