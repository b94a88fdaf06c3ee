//! FSDP memory, measured with the counting CPU allocator (in tests/alone/, one test at a time, so no
//! other test's allocations are counted): a unit whose gather has started holds its shards inside the gathered buffer,
//! so a prefetched unit costs its full size, not its full size plus its shards.
use crate::common;

use std::sync::{Arc, Mutex};
use std::time::Duration;

use tch::{nn, nn::Module, Device, Kind, Tensor};
use tch_dist::fsdp::{FsdpBuilder, FsdpOptions};
use tch_dist::memory;
use tch_dist::DistModule;

const WIDTH: i64 = 512;

#[test]
fn a_prefetched_unit_costs_its_full_size_only() {
    let _alone = common::alone();
    memory::install_cpu_counter().unwrap();
    // One rank: a unit's shards are the whole unit, so a gathered unit whose shards live inside its
    // buffer adds nothing, and one whose shards were copied in adds one unit (1 MiB here).
    let out = common::run_threads(1, Duration::from_secs(60), |pg| {
        let vs = nn::VarStore::new(Device::Cpu);
        let opts = FsdpOptions::default().process_group(Arc::new(pg)).prefetch(1);
        let fsdp = FsdpBuilder::new(&vs, opts).unwrap();
        let r = vs.root();
        let nb = nn::LinearConfig { bias: false, ..Default::default() };
        let units: Vec<_> = (0..3)
            .map(|i| {
                let p = &r / format!("l{i}");
                let l = nn::linear(&p, WIDTH, WIDTH, nb);
                fsdp.fully_shard(&p, l).unwrap()
            })
            .collect();
        // allocated bytes right after unit 0's forward: unit 0 freed, unit 1 prefetched
        let seen = Arc::new(Mutex::new(Vec::new()));
        let probe = seen.clone();
        let model = fsdp
            .finish(nn::func(move |x| {
                let h = units[0].forward(x);
                probe.lock().unwrap().push(memory::allocated(Device::Cpu).unwrap());
                units[2].forward(&units[1].forward(&h))
            }))
            .unwrap();
        let x = Tensor::ones([4, WIDTH], (Kind::Float, Device::Cpu));
        let mut before = Vec::new();
        for _ in 0..3 {
            // the first forward records the order of units; later ones prefetch along it
            before.push(memory::allocated(Device::Cpu).unwrap());
            let y = model.forward(&x);
            y.sum(Kind::Float).backward();
            model.zero_grad().unwrap();
        }
        let seen = seen.lock().unwrap().clone();
        (before, seen)
    });
    let (before, seen) = &out[0];
    let unit = WIDTH * WIDTH * 4;
    // the activation unit 0 kept and its output: 2 x 8 KiB
    let small = 64 << 10;
    assert!(seen[0] - before[0] < small, "first forward, nothing prefetched: {} B above", seen[0] - before[0]);
    for i in 1..3 {
        let extra = seen[i] - before[i];
        assert!(
            extra < small,
            "forward {i}: with unit 1 prefetched, {extra} B above the shards alone; a copy of its shards would be {unit} B"
        );
    }
}
