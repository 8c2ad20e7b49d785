//! The grouped expert GEMMs (`grouped_gemm.cu` through [`GroupedExperts`]) against a CPU f32
//! reference on the same bf16 operands: the activation `bf16(silu(x · gate) · (x · up))` within
//! one bf16 step of the reference's (a sum in another order can round the other way), and the
//! f32 output within 1e-5 of the row's largest value against the reference down projection of
//! the device's own activation. Ragged groups (empty, one row, partial and exact tiles, several
//! tiles, experts shared by groups), rows between groups and guard rows around the buffers that
//! must keep their bytes, runs of groups launched apart as the EP plane's slot waits split them,
//! several H / I, and the per-group cuBLAS path (the baseline, and the fallback for sizes that
//! are not multiples of 8) on the same cases.

use super::cuda_common::{default_devices, Device, Rng};
use rackfill_kernels::cuda::exec::{round_bf16, DeviceBuffer, Executor, ExecutorExt, Stream};
use rackfill_kernels::cuda::grouped_gemm::{ExpertGemms, ExpertGroup, ExpertRows, GroupedExperts};

/// Rows in front of and after the rows every buffer holds, and their byte.
const GUARD_ROWS: usize = 2;
const SENTINEL: u8 = 0x7f;
const EXPERTS: usize = 3;

/// `n` values in [-scale, scale), rounded to bf16.
fn values(rng: &mut Rng, n: usize, scale: f32) -> Vec<f32> {
    (0..n).map(|_| round_bf16(rng.unit() * scale)).collect()
}

fn bf16_bytes(values: &[f32]) -> Vec<u8> {
    values
        .iter()
        .map(|&v| (v.to_bits() >> 16) as u16)
        .flat_map(u16::to_le_bytes)
        .collect()
}

/// A buffer of `rows` rows of `row_bytes` with [`GUARD_ROWS`] guard rows on either side, every
/// byte [`SENTINEL`]; `rows` written at row 0 when given.
fn guarded(
    exec: &dyn Executor,
    rows: usize,
    row_bytes: usize,
    init: Option<&[u8]>,
) -> DeviceBuffer {
    let mut bytes = vec![SENTINEL; (rows + 2 * GUARD_ROWS) * row_bytes];
    if let Some(init) = init {
        bytes[GUARD_ROWS * row_bytes..][..init.len()].copy_from_slice(init);
    }
    exec.upload(&bytes).unwrap()
}

/// Row 0 of a [`guarded`] buffer.
fn row0(buffer: &DeviceBuffer, row_bytes: usize) -> u64 {
    buffer.at(GUARD_ROWS * row_bytes)
}

/// Group row counts laid out one after another, a row left out (never touched) after every
/// third group; the groups' experts cycle, so several groups share an expert.
fn layout(counts: &[usize]) -> (Vec<(usize, usize, usize)>, usize) {
    let mut start = 0;
    let groups = counts
        .iter()
        .enumerate()
        .map(|(g, &rows)| {
            let group = (start, rows, g % EXPERTS);
            start += rows + usize::from(g % 3 == 2);
            group
        })
        .collect();
    (groups, start)
}

/// `silu(g) * u` rounded to bf16, as the CPU model computes it.
fn silu_mul(g: f32, u: f32) -> f32 {
    round_bf16(g / (1.0 + (-g).exp()) * u)
}

/// One case on one device: groups of `counts` rows of width (h, i), launched in two runs.
fn check(dev: &Device, (h, i): (usize, usize), counts: &[usize], gemms: ExpertGemms, seed: u64) {
    let exec = dev.exec.as_ref();
    let what = format!("{} h {h} i {i} groups {counts:?} {gemms:?}", dev.name());
    let mut rng = Rng(seed);
    let (groups, rows) = layout(counts);
    let x = values(&mut rng, rows * h, 1.0);
    // Per expert `[2I, H]` then `[H, I]`, scaled to keep the activations O(1).
    let experts: Vec<Vec<f32>> = (0..EXPERTS)
        .map(|_| values(&mut rng, 3 * h * i, 2.0 / (h as f32).sqrt()))
        .collect();
    let weights = exec.upload(&bf16_bytes(&experts.concat())).unwrap();
    let at = |e: usize| weights.at(e * 3 * h * i * 2);
    let x_buf = guarded(exec, rows, h * 2, Some(&bf16_bytes(&x)));
    let act_buf = guarded(exec, rows, i * 2, None);
    let out_buf = guarded(exec, rows, h * 4, None);
    let io = ExpertRows {
        x: row0(&x_buf, h * 2),
        act: row0(&act_buf, i * 2),
        out: row0(&out_buf, h * 4),
    };
    let list: Vec<ExpertGroup> = groups
        .iter()
        .map(|&(start, rows, e)| ExpertGroup {
            start,
            rows,
            gate_up: at(e),
            down: at(e) + (2 * i * h * 2) as u64,
        })
        .collect();
    let run = GroupedExperts::new(exec, Stream::MAIN, (h, i), gemms, io, list).unwrap();
    let grouped = gemms == ExpertGemms::Grouped && h.is_multiple_of(8) && i.is_multiple_of(8);
    assert_eq!(run.grouped(), grouped, "{what}");
    let split = counts.len() / 2;
    run.run(0..split).unwrap();
    run.run(split..counts.len()).unwrap();
    exec.synchronize().unwrap();

    let act_bytes = read(exec, &act_buf);
    let out_bytes = read(exec, &out_buf);
    let mut in_group = vec![false; rows];
    for &(start, n, e) in &groups {
        let w = &experts[e];
        for r in start..start + n {
            in_group[r] = true;
            let xr = &x[r * h..][..h];
            let dot = |row: &[f32], v: &[f32]| row.iter().zip(v).map(|(a, b)| a * b).sum::<f32>();
            let act: Vec<f32> = (0..i)
                .map(|j| bf16_at(&act_bytes, (GUARD_ROWS + r) * i + j))
                .collect();
            for (j, &got) in act.iter().enumerate() {
                let want = silu_mul(dot(&w[j * h..][..h], xr), dot(&w[(i + j) * h..][..h], xr));
                let step = f32::from_bits(want.abs().to_bits() & 0x7f80_0000) / 128.0;
                assert!(
                    (got - want).abs() <= step + 1e-6,
                    "{what}: act[{r}, {j}] = {got}, reference {want}"
                );
            }
            let down = &w[2 * i * h..];
            let want: Vec<f32> = (0..h).map(|c| dot(&down[c * i..][..i], &act)).collect();
            let scale = want.iter().fold(1e-3f32, |m, v| m.max(v.abs()));
            for (c, &want) in want.iter().enumerate() {
                let got = f32_at(&out_bytes, (GUARD_ROWS + r) * h + c);
                assert!(
                    (got - want).abs() <= 1e-5 * scale,
                    "{what}: out[{r}, {c}] = {got}, reference {want}"
                );
            }
        }
    }
    // Guard rows and rows of no group keep every byte.
    let untouched = |bytes: &[u8], row_bytes: usize, name: &str| {
        for (row, chunk) in bytes.chunks(row_bytes).enumerate() {
            let inside = row >= GUARD_ROWS && row < GUARD_ROWS + rows;
            if !(inside && in_group[row - GUARD_ROWS]) {
                assert!(
                    chunk.iter().all(|&b| b == SENTINEL),
                    "{what}: {name} row {row} (guarded) was written"
                );
            }
        }
    };
    untouched(&act_bytes, i * 2, "act");
    untouched(&out_bytes, h * 4, "out");
}

fn read(exec: &dyn Executor, buffer: &DeviceBuffer) -> Vec<u8> {
    let mut bytes = vec![0u8; buffer.bytes()];
    exec.read(buffer, 0, &mut bytes).unwrap();
    bytes
}

fn bf16_at(bytes: &[u8], index: usize) -> f32 {
    f32::from_bits(u32::from(u16::from_le_bytes([bytes[2 * index], bytes[2 * index + 1]])) << 16)
}

fn f32_at(bytes: &[u8], index: usize) -> f32 {
    f32::from_le_bytes(bytes[4 * index..][..4].try_into().unwrap())
}

/// Empty groups, one row, a partial tile, exact tiles, several tiles with a partial last one.
const RAGGED: [usize; 8] = [0, 1, 70, 0, 13, 64, 129, 0];

#[test]
fn grouped_expert_gemms_match_the_cpu_reference() {
    for dev in default_devices() {
        for (n, shape) in [(64, 32), (128, 64), (96, 40), (256, 192)]
            .into_iter()
            .enumerate()
        {
            check(&dev, shape, &RAGGED, ExpertGemms::Grouped, 11 + n as u64);
        }
    }
}

#[test]
fn per_group_gemms_are_the_baseline_and_the_fallback() {
    for dev in default_devices() {
        check(&dev, (64, 32), &RAGGED, ExpertGemms::PerGroup, 5);
        // Not multiples of 8: the grouped kernels refuse them and the groups run one by one.
        check(&dev, (36, 20), &RAGGED, ExpertGemms::Grouped, 6);
    }
}

#[test]
fn groups_without_rows_launch_nothing_and_write_nothing() {
    for dev in default_devices() {
        check(&dev, (64, 32), &[0, 0, 0], ExpertGemms::Grouped, 7);
        check(&dev, (64, 32), &[], ExpertGemms::Grouped, 8);
    }
}

/// `LocalExperts` (the whole-model path: pairs ranked by expert and rows grouped on the device;
/// grouped: the tile table built there too; per-expert: only the row offsets copied back)
/// against the same experts over groups built on the host from the same routing (token order
/// within an expert): every pair's output bit for bit, and the pair-to-row map equal to the
/// host's grouping. Ragged routing: an expert nobody chose, one chosen by a single pair, one by
/// more pairs than a tile holds.
#[test]
fn experts_grouped_on_the_device_equal_groups_built_on_the_host() {
    use rackfill_kernels::cuda::local_experts::LocalExperts;
    for dev in default_devices() {
        let exec = dev.exec.as_ref();
        let (h, i, experts, rows, k) = (64, 32, 5, 50, 3);
        let mut rng = Rng(21);
        let x = values(&mut rng, rows * h, 1.0);
        let weights: Vec<(DeviceBuffer, DeviceBuffer)> = (0..experts)
            .map(|_| {
                let gate_up = values(&mut rng, 2 * i * h, 0.2);
                let down = values(&mut rng, h * i, 0.2);
                (
                    exec.upload(&bf16_bytes(&gate_up)).unwrap(),
                    exec.upload(&bf16_bytes(&down)).unwrap(),
                )
            })
            .collect();
        // Expert 4 nobody chooses, expert 3 only pair 0; the rest spread over the others.
        let ids: Vec<u32> = (0..rows * k)
            .map(|p| {
                if p == 0 {
                    3
                } else {
                    ((p * 7 + p / k) % 3) as u32
                }
            })
            .collect();
        let x_dev = exec.upload(&bf16_bytes(&x)).unwrap();
        let ids_dev = exec.upload_u32(&ids).unwrap();
        let pointers: Vec<(u64, u64)> = weights.iter().map(|(g, d)| (g.ptr(), d.ptr())).collect();
        let local = LocalExperts::upload(exec, &pointers, (h, i)).unwrap();

        // The host's grouping of the same routing.
        let mut order: Vec<usize> = (0..rows * k).collect();
        order.sort_by_key(|&p| ids[p]);
        let mut host_row_of = vec![0u32; rows * k];
        let mut grouped = Vec::with_capacity(rows * k * h);
        for (row, &p) in order.iter().enumerate() {
            host_row_of[p] = row as u32;
            grouped.extend_from_slice(&x[p / k * h..][..h]);
        }
        let grouped = exec.upload(&bf16_bytes(&grouped)).unwrap();
        let mut start = 0;
        let groups: Vec<ExpertGroup> = (0..experts)
            .map(|e| {
                let n = ids.iter().filter(|&&id| id as usize == e).count();
                start += n;
                ExpertGroup {
                    start: start - n,
                    rows: n,
                    gate_up: pointers[e].0,
                    down: pointers[e].1,
                }
            })
            .collect();
        for gemms in [ExpertGemms::Grouped, ExpertGemms::PerGroup] {
            let what = format!("{} {gemms:?}", dev.name());
            let done = local.run(exec, &x_dev, (rows, k), &ids_dev, gemms).unwrap();
            let row_of = exec.download_u32(&done.row_of).unwrap();
            assert_eq!(row_of, host_row_of, "{what}: pair rows");
            let (act, host_out) = (
                exec.alloc_zeroed(rows * k * i * 2).unwrap(),
                exec.alloc_zeroed(rows * k * h * 4).unwrap(),
            );
            let rows_io = ExpertRows {
                x: grouped.ptr(),
                act: act.ptr(),
                out: host_out.ptr(),
            };
            GroupedExperts::new(exec, Stream::MAIN, (h, i), gemms, rows_io, groups.clone())
                .unwrap()
                .run_all()
                .unwrap();
            assert!(
                read(exec, &done.out) == read(exec, &host_out),
                "{what}: device-grouped outputs differ from host-grouped ones"
            );
        }
    }
}
