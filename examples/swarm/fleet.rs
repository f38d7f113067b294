//! The fleets the scenarios run on, and the calibration of their backends.
//!
//! Calibration, from the study (Qwen3.8-27B on one A4000-pair host and three Radeon VII-pair
//! hosts):
//!
//! - a Radeon VII pair prefills about 200 tokens/s (a cold 30,000-token prompt: 150 s);
//! - an A4000 pair reads prompts about three times faster: 600 tokens/s;
//! - a warm turn took about 1.3 s to first token: 0.5 s of fixed overhead plus a typical tool
//!   output (160 tokens, the median the agents draw) prefilled at 200 tokens/s;
//! - KV is 128 KiB a token in host memory (64 layers x 4 KV heads x 128 dims x K and V x f16),
//!   so llama.cpp's default 8 GiB RAM cache holds about 65,000 tokens, two or three sessions'
//!   contexts: the study saw eviction misses with three sessions at 8 GiB and none at 64 GiB;
//! - restoring from RAM runs at 25,000 tokens/s (3.2 GB/s over PCIe): a 30,000-token state
//!   costs 1.2 s, far less than prefill;
//! - decoding: 18 tokens/s a slot on a Radeon VII pair, 25 on an A4000 pair;
//! - each GPU pair holds about 120,000 tokens of KV beside the weights, shared by its slots.
//!
//! Assumed, not from the study: each host runs two backends, each simulated with a whole GPU
//! pair (its prefill rate and its 120,000 tokens of KV) and a RAM cache of its own, with five
//! or four slots (34 in all, as the study had). The study names pair hosts and several GPU
//! processes a node, but not how they shared the GPUs; if a host's two backends shared one
//! pair, each would have about half that KV and share the prefill, and every policy would hit
//! less.
//!
//! Not modelled by default: a request admitted while the busy slots' KV exceeds the VRAM runs
//! all the same (a real backend would wait for room, or refuse a prompt longer than its slot's
//! share of the context). The RAM line under each table counts how often that happens.
//! `--vram wait` makes a backend wait for room instead, serving its queue in order
//! ([`Vram::Wait`](crate::cache::Vram::Wait)). llama-server itself does neither: it clears
//! idle slots, then halves its batch, and in the end fails the requests it runs. By default
//! the slots share the VRAM, as llama-server's unified KV cache does, and an idle slot's state
//! goes to RAM to make room for another's; `--vram split` gives each slot a context of its own
//! instead, as llama-server with `-np` given does ([`Vram::Split`](crate::cache::Vram::Split)).
//!
//! Also not modelled by default: a backend's other slots decode at full pace while it reads a
//! prompt, and a state saved to the RAM cache costs no time; llama-server does both in the
//! one loop that reads prompts. `--gpu-work all` models them
//! ([`GpuWork::All`](crate::backend::GpuWork::All)).
//!
//! Moved turns are not calibrated but measured. The study saw a median 26 s for a move within a
//! node and about 120 s across nodes; the simulation gives about 59 s and 58 s (the study
//! table's `median TTFT` line): the backends of a node share nothing here (no GPU, no RAM
//! cache), so a move within a node costs what a move across nodes does, and the preference for
//! the home's node is not rewarded in these figures.

use std::time::Duration;

use crate::backend::Model;

/// KV bytes a token of the study's model takes in host memory.
pub(crate) const KV_BYTES_PER_TOKEN: u64 = 128 << 10;

/// KV tokens a GPU pair holds beside the weights: 2 x 16 GB less about 17 GB of weights,
/// at 128 KiB a token.
const VRAM_TOKENS: u64 = 120_000;

const OVERHEAD: Duration = Duration::from_millis(500);
const RESTORE_TPS: f64 = 25_000.0;

pub(crate) fn radeon_vii_pair(slots: u32, ram_bytes: u64) -> Model {
    Model {
        prefill_tps: 200.0,
        restore_tps: RESTORE_TPS,
        decode_tps: 18.0,
        overhead: OVERHEAD,
        slots,
        ram_bytes,
        kv_bytes_per_token: KV_BYTES_PER_TOKEN,
        vram_tokens: VRAM_TOKENS,
    }
}

pub(crate) fn a4000_pair(slots: u32, ram_bytes: u64) -> Model {
    Model {
        prefill_tps: 600.0,
        decode_tps: 25.0,
        ..radeon_vii_pair(slots, ram_bytes)
    }
}

/// A data-centre GPU serving the same model: sized so the Mooncake trace (about 60,000 prompt
/// tokens a second) loads the fleet without drowning it.
pub(crate) fn datacenter_gpu(slots: u32, ram_bytes: u64) -> Model {
    Model {
        prefill_tps: 8_000.0,
        restore_tps: 100_000.0,
        decode_tps: 40.0,
        overhead: Duration::from_millis(150),
        slots,
        ram_bytes,
        kv_bytes_per_token: KV_BYTES_PER_TOKEN,
        vram_tokens: 4 * VRAM_TOKENS,
    }
}

/// One backend of a fleet.
#[derive(Clone, Debug)]
pub(crate) struct BackendSpec {
    pub(crate) id: String,
    pub(crate) node: String,
    pub(crate) model: Model,
}

/// Which fleet a scenario runs on.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum FleetKind {
    /// The study's: one A4000-pair host with 2 backends x 5 slots, three Radeon VII-pair hosts
    /// with 2 backends x 4 slots each; 34 slots.
    Study,
    /// Two Radeon VII-pair hosts with one 1-slot backend each: two slots.
    TwoSlots,
    /// Eight hosts with 2 backends x 8 slots each: 128 slots.
    Datacenter,
}

impl FleetKind {
    pub(crate) fn parse(s: &str) -> Option<Self> {
        match s {
            "study" => Some(FleetKind::Study),
            "two-slots" => Some(FleetKind::TwoSlots),
            "datacenter" => Some(FleetKind::Datacenter),
            _ => None,
        }
    }

    pub(crate) fn backends(self, ram_bytes: u64) -> Vec<BackendSpec> {
        let spec = |node: String, i: u32, model: Model| BackendSpec {
            id: format!("{node}/{i}"),
            node,
            model,
        };
        let mut v = Vec::new();
        match self {
            FleetKind::Study => {
                for i in 0..2 {
                    v.push(spec("a4000".into(), i, a4000_pair(5, ram_bytes)));
                }
                for n in 1..=3 {
                    for i in 0..2 {
                        v.push(spec(format!("radeon{n}"), i, radeon_vii_pair(4, ram_bytes)));
                    }
                }
            }
            FleetKind::TwoSlots => {
                for n in 1..=2 {
                    v.push(spec(format!("radeon{n}"), 0, radeon_vii_pair(1, ram_bytes)));
                }
            }
            FleetKind::Datacenter => {
                for n in 1..=8 {
                    for i in 0..2 {
                        v.push(spec(format!("dc{n}"), i, datacenter_gpu(8, ram_bytes)));
                    }
                }
            }
        }
        v
    }

    pub(crate) fn describe(self) -> &'static str {
        match self {
            FleetKind::Study => {
                "study fleet: 1 A4000-pair host (2 backends x 5 slots) + 3 Radeon VII-pair hosts (2 x 4), 34 slots"
            }
            FleetKind::TwoSlots => "2 Radeon VII-pair hosts, 1 backend x 1 slot each",
            FleetKind::Datacenter => {
                "datacenter fleet: 8 hosts x 2 backends x 8 slots, 8,000 prefill tokens/s a backend"
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_study_fleet_has_34_slots_on_four_hosts() {
        let b = FleetKind::Study.backends(8 << 30);
        assert_eq!(b.iter().map(|b| b.model.slots).sum::<u32>(), 34);
        let mut nodes: Vec<_> = b.iter().map(|b| b.node.as_str()).collect();
        nodes.dedup();
        assert_eq!(nodes.len(), 4);
    }
}
