//! Loads a checkpoint onto the host emulator (or, with `--gpu`, GPU 0) with `GpuModel::load`,
//! the home experts of one rank of an EP layout included, and does nothing else (the emulator is
//! far too slow to run a forward at a real model's shape): the process whose host memory
//! `scripts/load_memory.py` samples while it loads.
//!
//! ```sh
//! cargo run -p rackfill-models --features cuda --example load_gpu -- DIR [EP_SIZE [RANK]] [--gpu]
//! ```
//!
//! Prints one JSON line: seconds, bytes written to the device (the emulator counts them; null on
//! a GPU), home expert bytes, the device.

use std::error::Error;
use std::path::PathBuf;
use std::sync::Arc;
use std::time::Instant;

use rackfill_balancer::Layout;
use rackfill_kernels::cuda::exec::{Emulator, Executor, GpuExecutor};
use rackfill_models::gpu::{ExpertPlacement, GpuModel};
use rackfill_models::{Checkpoint, ModelConfig};

fn main() -> Result<(), Box<dyn Error>> {
    let mut args: Vec<String> = std::env::args().skip(1).collect();
    let gpu = args.iter().any(|a| a == "--gpu");
    args.retain(|a| a != "--gpu");
    let usage = "usage: load_gpu DIR [EP_SIZE [RANK]] [--gpu]";
    let dir = PathBuf::from(args.first().ok_or(usage)?);
    let ep: usize = args.get(1).map_or(Ok(1), |s| s.parse())?;
    let rank: usize = args.get(2).map_or(Ok(0), |s| s.parse())?;
    let (exec, emulator): (Arc<dyn Executor>, _) = if gpu {
        (Arc::new(GpuExecutor::open(0)?), None)
    } else {
        let emulator = Emulator::shared().ok_or("the host emulator needs a C++ compiler")?;
        (emulator.clone(), Some(emulator))
    };
    let config = ModelConfig::load(&dir)?;
    let checkpoint = Checkpoint::open(&dir)?;
    let layout = Layout::contiguous(ep, config.moe.num_experts, 0)?;
    let placement = ExpertPlacement::Homes {
        layout: &layout,
        local: rank..rank + 1,
    };
    let start = Instant::now();
    let (model, homes) = GpuModel::load(exec.clone(), &config, &checkpoint, 256, placement)?;
    exec.synchronize()?;
    let seconds = start.elapsed().as_secs_f64();
    let home_bytes: usize = homes
        .iter()
        .flat_map(|h| &h.buffers)
        .map(|b| b.bytes())
        .sum();
    let written = emulator.map_or("null".to_string(), |e| e.bytes_uploaded().to_string());
    println!(
        "{{\"seconds\": {seconds:.3}, \"bytes_written\": {written}, \
         \"home_expert_bytes\": {home_bytes}, \"device\": {:?}}}",
        model.describe()
    );
    Ok(())
}
