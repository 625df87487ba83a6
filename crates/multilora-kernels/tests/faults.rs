//! The strict emulator catches what a GPU would get wrong silently: kernels with one planted
//! fault each (`src/emulate/faults.cuh`, built only into the harness of
//! [`Emulator::with_planted_faults`]) must fail with a report that names the fault, the kernel,
//! and the view, field or lanes involved; a correct kernel that uses the same features passes
//! with the right result.

use multilora_kernels::{Emulator, Error, FaultKind, Memory};

/// `MlFaultParams` of `faults.cuh`: `in`, `out`, `n`, padding.
fn params(input: u64, out: u64, n: u32) -> Vec<u8> {
    [input.to_le_bytes().as_slice(), &out.to_le_bytes(), &n.to_le_bytes(), &0u32.to_le_bytes()].concat()
}

fn floats(v: &[f32]) -> Vec<u8> {
    v.iter().flat_map(|x| x.to_le_bytes()).collect()
}

/// Runs a planted-fault kernel over `n` input floats `0, 1, 2, …` and `out_len` zeroed output
/// floats; the output and the launch's result.
fn run(emu: &Emulator, kernel: &str, grid: u32, block: u32, n: usize, out_len: usize) -> (Vec<f32>, Result<(), Error>) {
    let mut mem = Memory::new();
    let input = mem.add(floats(&(0..n).map(|i| i as f32).collect::<Vec<_>>()));
    let out = mem.add(vec![0; 4 * out_len]);
    let r = emu.launch(kernel, [grid, 1, 1], [block, 1, 1], &params(input, out, n as u32), &mut mem);
    let bytes = mem.get(out).expect("a pointer this memory made");
    (bytes.chunks_exact(4).map(|c| f32::from_le_bytes(c.try_into().unwrap())).collect(), r)
}

/// The fault's detail, after checking its kind and that it names the kernel.
fn fault(r: Result<(), Error>, kernel: &str, want: FaultKind) -> String {
    match r {
        Err(Error::Fault { kernel: k, kind, detail }) => {
            assert_eq!(k, kernel);
            assert_eq!(kind, want, "{detail}");
            assert!(detail.contains(kernel), "the report names the kernel: {detail}");
            detail
        }
        other => panic!("{kernel}: expected a {want} fault, got {other:?}"),
    }
}

fn assert_mentions(detail: &str, parts: &[&str]) {
    for p in parts {
        assert!(detail.contains(p), "the report should say {p:?}: {detail}");
    }
}

/// Races show only when a launch runs under more than one schedule (the default).
fn races_checked() -> bool {
    let one = std::env::var("MULTILORA_EMU_SCHEDULES").is_ok_and(|v| v.trim() == "1");
    if one {
        println!("SKIPPED: MULTILORA_EMU_SCHEDULES=1 turns the race check off");
    }
    !one
}

#[test]
fn a_race_between_blocks_is_caught() {
    let Some(emu) = Emulator::with_planted_faults_for_tests() else { return };
    if !races_checked() {
        return;
    }
    let (_, r) = run(emu, "ml_fault_race", 32, 32, 1, 33);
    let d = fault(r, "ml_fault_race", FaultKind::Race);
    assert_mentions(&d, &["a race between blocks", "view 1 (out: buffer 1", "MULTILORA_EMU_SEED=0x"]);
}

#[test]
fn a_race_between_blocks_interleaved_at_a_barrier_is_caught() {
    let Some(emu) = Emulator::with_planted_faults_for_tests() else { return };
    if !races_checked() {
        return;
    }
    // In any order one block at a time, out[1 + b] = b and out[0] = 0: only interleaving shows it.
    let (_, r) = run(emu, "ml_fault_race_across_barrier", 6, 32, 1, 7);
    let d = fault(r, "ml_fault_race_across_barrier", FaultKind::Race);
    assert_mentions(&d, &["a race between blocks", "interleaved at __syncthreads", "view 1 (out: buffer 1"]);
}

#[test]
fn a_race_between_threads_of_a_block_is_caught() {
    let Some(emu) = Emulator::with_planted_faults_for_tests() else { return };
    if !races_checked() {
        return;
    }
    let (_, r) = run(emu, "ml_fault_thread_race", 1, 64, 64, 64);
    let d = fault(r, "ml_fault_thread_race", FaultKind::Race);
    assert_mentions(&d, &["a race between threads of one block", "view 1 (out: buffer 1"]);
}

#[test]
fn a_read_past_the_end_of_a_view_is_caught() {
    let Some(emu) = Emulator::with_planted_faults_for_tests() else { return };
    // 100 floats: the view ends on a 16-byte boundary, so the first byte past it faults.
    let (_, r) = run(emu, "ml_fault_read_past_end", 4, 32, 100, 100);
    let d = fault(r, "ml_fault_read_past_end", FaultKind::OutOfBounds);
    assert_mentions(
        &d,
        &["block (3,0,0) thread (3,0,0) reads byte 400 of view 0 (in: buffer 0 bytes [0, 400)), past its end"],
    );
}

#[test]
fn a_read_past_a_ragged_end_changes_the_result_and_is_caught() {
    let Some(emu) = Emulator::with_planted_faults_for_tests() else { return };
    if !races_checked() {
        return;
    }
    // 99 floats: the float past the end lies in the view's alignment slack, read as poison.
    let (_, r) = run(emu, "ml_fault_read_past_end", 4, 32, 99, 99);
    let d = fault(r, "ml_fault_read_past_end", FaultKind::OutOfBounds);
    assert_mentions(&d, &["where the views lie in memory", "view 1 (out: buffer 1", "its byte 392"]);
}

#[test]
fn a_read_before_the_start_of_a_view_is_caught() {
    let Some(emu) = Emulator::with_planted_faults_for_tests() else { return };
    if !races_checked() {
        return;
    }
    let (_, r) = run(emu, "ml_fault_read_before_start", 4, 32, 100, 100);
    let d = fault(r, "ml_fault_read_before_start", FaultKind::OutOfBounds);
    assert_mentions(&d, &["block (0,0,0) thread (0,0,0) reads byte -4 of view 0 (in: buffer 0", "before its start"]);
}

#[test]
fn a_write_past_the_end_of_a_view_is_caught() {
    let Some(emu) = Emulator::with_planted_faults_for_tests() else { return };
    let (_, r) = run(emu, "ml_fault_write_past_end", 4, 32, 100, 100);
    let d = fault(r, "ml_fault_write_past_end", FaultKind::OutOfBounds);
    assert_mentions(&d, &["thread (3,0,0) writes byte 400 of view 1 (out: buffer 1 bytes [0, 400)), past its end"]);
}

#[test]
fn a_narrower_view_bounds_its_field() {
    let Some(emu) = Emulator::with_planted_faults_for_tests() else { return };
    // `in` and `out` in one buffer: `in` may not reach into `out`'s half.
    let mut mem = Memory::new();
    let whole = mem.add(floats(&[1.0; 200]));
    let input = mem.view(whole, 400).unwrap();
    let out = mem.view(whole + 400, 400).unwrap();
    let r = emu.launch("ml_fault_read_past_end", [4, 1, 1], [32, 1, 1], &params(input, out, 100), &mut mem);
    let d = fault(r, "ml_fault_read_past_end", FaultKind::OutOfBounds);
    assert_mentions(&d, &["reads byte 400 of view 1 (in: buffer 0 bytes [0, 400)), past its end"]);
}

#[test]
fn a_mask_that_names_exited_lanes_is_caught() {
    let Some(emu) = Emulator::with_planted_faults_for_tests() else { return };
    let (_, r) = run(emu, "ml_fault_mask_exited", 1, 32, 32, 1);
    let d = fault(r, "ml_fault_mask_exited", FaultKind::WarpSync);
    assert_mentions(&d, &["__shfl_xor_sync with mask 0xffffffff", "0xffff0000", "exited"]);
}

#[test]
fn a_mask_that_leaves_out_calling_lanes_is_caught() {
    let Some(emu) = Emulator::with_planted_faults_for_tests() else { return };
    let (_, r) = run(emu, "ml_fault_mask_partial", 1, 32, 32, 32);
    let d = fault(r, "ml_fault_mask_partial", FaultKind::WarpSync);
    assert_mentions(&d, &["__shfl_xor_sync with mask 0x0000ffff leaves out the calling lane 16"]);
}

#[test]
fn a_launch_past_the_limits_is_caught() {
    let Some(emu) = Emulator::with_planted_faults_for_tests() else { return };
    let (_, r) = run(emu, "ml_fault_ok", 1, 2048, 32, 1);
    let d = fault(r, "ml_fault_ok", FaultKind::Launch);
    assert_mentions(&d, &["2048 threads per block"]);
}

#[test]
fn a_correct_kernel_passes_with_the_right_result() {
    let Some(emu) = Emulator::with_planted_faults_for_tests() else { return };
    // Three blocks of 64 threads over 150 values: the last block is partly empty.
    let (out, r) = run(emu, "ml_fault_ok", 3, 64, 150, 3);
    r.expect("a correct kernel passes");
    let want: Vec<f32> = (0..3).map(|b| (64 * b..(64 * b + 64).min(150)).map(|i| i as f32).sum()).collect();
    assert_eq!(out, want);
}
