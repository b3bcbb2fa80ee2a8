//! The bf16 back-end: which kernel runs `dtype = "bfloat16"`'s products, chosen once at
//! start-up ([`Backend::detect`]) from what the CPU and the build offer ([`Offer`]) and
//! what the user asked for (the `bf16_kernel` key, `--bf16-kernel`), and everything
//! that follows from that choice: whether the model packs its weights or keeps a
//! rounded copy of them, the classifier's `dwte` blocks, whether attention runs its
//! products on `vdpbf16ps`, and so the memory plan's bytes. The value is passed to the
//! model, the plan and `bench`; nothing else decides or re-derives it.
//!
//! Products run on one of four kernels; on oneDNN only the large ones (at least 2^20
//! multiply-adds; below that its operand copies cost more than they save), the rest on
//! the f32 GEMM over bf16-valued operands (the same products up to summation order).
//! Our AMX and AVX512-BF16 kernels take every product, whatever its size: they round
//! their operands while packing them, so a model whose products run on them keeps no
//! rounded copy of its weights, and a small product reads the same weights (the packs
//! of the last refresh) as a large one:
//! - our AMX-BF16 kernel ([`super::amx`]) when the CPU has AMX-BF16 and Linux grants
//!   the process the tile permission;
//! - oneDNN's bf16 matmul (`super::onednn`), in builds with the `onednn` feature
//!   when the library has a fast implementation for this CPU (AMX or AVX512-BF16);
//! - our AVX512-BF16 kernel ([`super::dpbf16`], `vdpbf16ps`) when the CPU has
//!   AVX512-BF16, except on Intel CPUs (below);
//! - the f32 GEMM otherwise.
//!
//! The default order is by measurement. On a 2-vCPU Xeon with AMX (2026-12-02) our
//! AMX kernel ran a 124M step's products 1.42× as fast as oneDNN with its operand
//! copies (`cargo bench --features onednn --bench bf16`, wall clock) and the whole
//! bf16 step in 3.2–3.9 s against oneDNN's 4.2–5.7 (docs/PERFORMANCE.md, "bf16 on
//! AMX"), so AMX comes first. Without AMX, oneDNN comes next. On an AVX512-BF16 CPU
//! without AMX our AVX512-BF16 kernel ran every linear and classifier product of a
//! 124M step at 1.2–2.0× the f32 GEMM and 0.77–1.05× oneDNN (0.89× over the step; per
//! CPU-second, `cargo bench --bench bf16`, docs/PERFORMANCE.md, "bf16 without AMX: the
//! AVX512-BF16 kernel"). The classifier's input gradient (k = V) runs on it only from
//! `wte` packed beforehand; packing both long operands per call it lost to the f32
//! GEMM (`DPBF16_MAX_K` in [`super::gemm`]). An earlier AVX512-BF16 kernel (one 8 × 32
//! block per task, no cache blocking) never beat the f32 GEMM and was removed. That
//! CPU was an AMD EPYC (Zen 4). On an Intel Xeon with AVX512-BF16 and AMX hidden
//! (Sapphire Rapids class, 2 vCPUs) the same kernel ran every one of 124M's products
//! at 0.56–0.73× the f32 GEMM (`cargo test --release --lib dpbf16_speed -- --ignored
//! --nocapture`): there `vdpbf16ps` does no more multiply-adds per cycle than the two
//! f32 FMA units, and the operands' packing and rounding come on top. So on Intel CPUs
//! the f32 GEMM comes before it, and the choice stays a pure function of the machine
//! and the request: a run and its resume pick the same kernel, and so the same bits.
//! A kernel asked for that is not usable here (not built, no AMX, no AVX512-BF16)
//! falls back to the default order, and `bench`/`train` say so ([`Backend::describe`]).

use crate::kernels::cpu;

/// Which kernel runs the bf16 products.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum Kernel {
    /// AMX-BF16 tiles ([`super::amx`]).
    Amx,
    /// AVX512-BF16 (`vdpbf16ps`, [`super::dpbf16`]).
    Avx512Bf16,
    /// The f32 GEMM over bf16-valued operands.
    F32,
    /// oneDNN's bf16 matmul (`super::onednn`; only with the `onednn` feature).
    OneDnn,
}

impl Kernel {
    /// Every kernel, by the name the `bf16_kernel` key and `--bf16-kernel` take.
    pub const ALL: [(&'static str, Kernel); 4] = [
        ("amx", Kernel::Amx),
        ("avx512bf16", Kernel::Avx512Bf16),
        ("onednn", Kernel::OneDnn),
        ("f32", Kernel::F32),
    ];

    /// The names a request may use: `auto` (the default order) or a kernel's.
    pub const REQUEST_NAMES: [&'static str; 5] = ["auto", "amx", "avx512bf16", "onednn", "f32"];

    /// The kernel named `name` (as in [`Kernel::ALL`]).
    pub fn from_name(name: &str) -> Option<Kernel> {
        Kernel::ALL
            .iter()
            .find(|(n, _)| *n == name)
            .map(|&(_, k)| k)
    }

    /// This kernel's name (as in [`Kernel::ALL`]).
    pub fn name(self) -> &'static str {
        Kernel::ALL
            .iter()
            .find(|(_, k)| *k == self)
            .map_or("?", |(n, _)| n)
    }

    /// A request by name: `auto` is none (the default order), else a kernel; None
    /// (the outer one) for a name that is neither.
    pub fn parse_request(name: &str) -> Option<Option<Kernel>> {
        match name {
            "auto" => Some(None),
            _ => Kernel::from_name(name).map(Some),
        }
    }
}

/// What this machine and this build offer the bf16 products: the facts the back-end
/// is chosen from.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Offer {
    /// The CPU has AMX-BF16 (whether or not the OS lets the process use it).
    pub amx_cpu: bool,
    /// AMX-BF16 and the tile permission.
    pub amx: bool,
    /// AVX512-BF16 (with AVX-512 F).
    pub avx512_bf16: bool,
    /// AVX-512 F, AVX2 and FMA: attention's widest variant, which its bf16 products
    /// build on.
    pub avx512: bool,
    /// oneDNN is built in and has a fast bf16 matmul for this CPU.
    pub onednn: bool,
    /// An Intel CPU, where the f32 GEMM beats our AVX512-BF16 kernel.
    pub intel: bool,
}

impl Offer {
    /// This machine's, asked of the CPU, the OS and the oneDNN library.
    pub fn detect() -> Offer {
        #[cfg(target_arch = "x86_64")]
        let avx512 = is_x86_feature_detected!("avx512f")
            && is_x86_feature_detected!("avx2")
            && is_x86_feature_detected!("fma");
        #[cfg(not(target_arch = "x86_64"))]
        let avx512 = false;
        #[cfg(feature = "onednn")]
        let onednn = super::onednn::available();
        #[cfg(not(feature = "onednn"))]
        let onednn = false;
        Offer {
            amx_cpu: cpu::has_amx(),
            amx: cpu::amx_permitted(),
            avx512_bf16: cpu::avx512_bf16(),
            avx512,
            onednn,
            intel: cpu::intel(),
        }
    }

    /// Nothing but the f32 GEMM.
    pub fn none() -> Offer {
        Offer {
            amx_cpu: false,
            amx: false,
            avx512_bf16: false,
            avx512: false,
            onednn: false,
            intel: false,
        }
    }

    /// Whether kernel `k` can run here.
    pub fn usable(&self, k: Kernel) -> bool {
        match k {
            Kernel::F32 => true,
            Kernel::Amx => self.amx,
            Kernel::Avx512Bf16 => self.avx512_bf16,
            Kernel::OneDnn => self.onednn,
        }
    }

    /// The kernels, fastest first as measured: the AVX512-BF16 kernel after the f32
    /// GEMM on Intel CPUs (see the module comment).
    fn default_order(&self) -> [Kernel; 4] {
        use Kernel::*;
        match self.intel {
            true => [Amx, OneDnn, F32, Avx512Bf16],
            false => [Amx, OneDnn, Avx512Bf16, F32],
        }
    }
}

/// The bf16 back-end of a process: the kernel its bf16 products run on, and what
/// follows from it (the module comment). Made once at start-up and passed down.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Backend {
    kernel: Kernel,
    requested: Option<Kernel>,
    offer: Offer,
}

/// Vocabulary rows of `dwte` per f32 product in the classifier's weight gradient
/// ([`Backend::dwte_block`]).
const DWTE_BLOCK: usize = 4096;

impl Backend {
    /// The kernel `requested` if `offer` can run it, else the first of the default
    /// order that it can: the one decision of the bf16 back-end.
    pub fn choose(requested: Option<Kernel>, offer: Offer) -> Backend {
        let usable = |k: &Kernel| offer.usable(*k);
        let kernel = requested.filter(usable).unwrap_or_else(|| {
            let order = offer.default_order().into_iter();
            order.into_iter().find(usable).unwrap_or(Kernel::F32)
        });
        Backend {
            kernel,
            requested,
            offer,
        }
    }

    /// [`Backend::choose`] on this machine's [`Offer`].
    pub fn detect(requested: Option<Kernel>) -> Backend {
        Backend::choose(requested, Offer::detect())
    }

    /// Every bf16 product on the f32 GEMM, attention's included, whatever the machine:
    /// the back-end a model starts on until it is given this machine's.
    pub fn portable() -> Backend {
        Backend::choose(None, Offer::none())
    }

    /// This machine's back-end forced onto kernel `k`, if `k` runs here (tests that
    /// compare kernels).
    pub fn with_kernel(k: Kernel) -> Option<Backend> {
        let backend = Backend::detect(Some(k));
        (backend.kernel == k).then_some(backend)
    }

    /// The kernel the bf16 products run on.
    pub fn kernel(&self) -> Kernel {
        self.kernel
    }

    /// What the machine offers.
    pub fn offer(&self) -> Offer {
        self.offer
    }

    /// Whether bf16 products read right-hand operands packed beforehand
    /// ([`super::gemm::WeightPacks`]): true for the AMX and AVX512-BF16 kernels, which
    /// read the same pack and round any f32 operand while packing it, so a model
    /// whose products run on them reads its f32 weights, or packs made from them, and
    /// keeps no rounded copy.
    pub fn reads_packs(&self) -> bool {
        matches!(self.kernel, Kernel::Amx | Kernel::Avx512Bf16)
    }

    /// Whether a model (`bf16`: in bf16 autocast) packs its weights once per refresh:
    /// bf16 products on a kernel that reads packs, weights not `lent` (ZeRO-3 packs per
    /// call: each gathered block's weight is read once per pass, so packing it on
    /// arrival would pack as often).
    pub fn packs_weights(&self, bf16: bool, lent: bool) -> bool {
        bf16 && !lent && self.reads_packs()
    }

    /// Whether a model (`bf16`: in bf16 autocast) keeps its weights rounded to bf16 in
    /// a copy (held as f32, the arena's layout) for its products: in bf16 wherever it
    /// does not pack them ([`Backend::packs_weights`]). The f32 GEMM and oneDNN read a
    /// product's operands as they are; lent weights (ZeRO-3, rounded range by range)
    /// pack per call, and their products include the classifier's input gradient,
    /// which the AVX512-BF16 kernel leaves to the f32 GEMM without `wte`'s pack.
    pub fn keeps_bf16_copy(&self, bf16: bool, lent: bool) -> bool {
        bf16 && !self.packs_weights(bf16, lent)
    }

    /// Floats of the bf16 copy of a `params_len` arena ([`Backend::keeps_bf16_copy`]).
    pub fn bf16_copy_len(&self, bf16: bool, lent: bool, params_len: usize) -> usize {
        match self.keeps_bf16_copy(bf16, lent) {
            true => params_len,
            false => 0,
        }
    }

    /// Vocabulary rows of `dwte` per product in the classifier's weight gradient, for
    /// a `v`-row vocabulary (`bf16`: in bf16 autocast): one product over all of V where
    /// the bf16 kernel is AMX (it packs into buffers it keeps, and in blocks it would
    /// repack the chunk's x for every block), 4,096 elsewhere: where the `gemm` crate
    /// runs the product (f32, bf16 on the f32 GEMM) one product over V packs an R × V
    /// buffer per chunk, 51 MB at GPT-2's R = 256 (with glibc's adaptive mmap threshold
    /// that no longer faults in every step, measured, but it leaves the caches); the
    /// AVX512-BF16 kernel and oneDNN take the 4,096-row blocks too (the AVX512-BF16
    /// kernel ran them at 1.9–2.0× the f32 GEMM, per CPU-second, `cargo bench --bench
    /// bf16`).
    pub fn dwte_block(&self, bf16: bool, v: usize) -> usize {
        match bf16 && self.kernel == Kernel::Amx {
            true => v,
            false => DWTE_BLOCK,
        }
    }

    /// Whether bf16 attention may run its products on `vdpbf16ps` (attention decides
    /// by head size and sequence length where it pays): a CPU with AVX512-BF16 on top
    /// of AVX-512, unless the products are on the f32 GEMM (a request for `f32` puts
    /// attention's there too).
    pub fn attention_pairs(&self) -> bool {
        self.offer.avx512 && self.offer.avx512_bf16 && self.kernel != Kernel::F32
    }

    /// Why the kernel asked for is not the one running, if it is not.
    pub fn refused(&self) -> Option<String> {
        let want = self.requested.filter(|&k| k != self.kernel)?;
        let name = want.name();
        Some(match want {
            Kernel::OneDnn if cfg!(not(feature = "onednn")) => {
                format!(
                    "bf16_kernel = {name}: this build has no oneDNN (build with --features onednn)"
                )
            }
            #[cfg(feature = "onednn")]
            Kernel::OneDnn => format!(
                "bf16_kernel = {name}: oneDNN is not usable here ({})",
                super::onednn::unavailable_reason().unwrap_or_default()
            ),
            Kernel::Avx512Bf16 => format!("bf16_kernel = {name}: this CPU has no AVX512-BF16"),
            _ => format!("bf16_kernel = {name}: this CPU or OS does not allow AMX"),
        })
    }

    /// How the bf16 products are computed, for the `bf16 matmuls:` line `train` and
    /// `bench` print at the start of a bfloat16 run.
    pub fn describe(&self) -> String {
        let line = match self.kernel {
            #[cfg(feature = "onednn")]
            Kernel::OneDnn => {
                let name = super::onednn::implementation().unwrap_or("?");
                format!(
                    "oneDNN ({name}) for the large products, f32 GEMM over bf16 values elsewhere"
                )
            }
            #[cfg(not(feature = "onednn"))]
            Kernel::OneDnn => unreachable!("oneDNN is not built in"),
            Kernel::Amx => "AMX-BF16 (tdpbf16ps) for the linear and classifier products, \
                            weights rounded while packed"
                .into(),
            Kernel::Avx512Bf16 => "AVX512-BF16 (vdpbf16ps) for the linear and classifier \
                                   products, weights rounded while packed"
                .into(),
            Kernel::F32 if self.requested == Some(Kernel::F32) => {
                "emulated via f32 GEMM (bf16 operands, f32 accumulation), as bf16_kernel = f32 asks"
                    .into()
            }
            Kernel::F32 if self.offer.amx_cpu => {
                "emulated via f32 GEMM (bf16 operands, f32 accumulation); the CPU has AMX but \
                 the OS refused the tile permission"
                    .into()
            }
            Kernel::F32 => {
                "emulated via f32 GEMM (bf16 operands, f32 accumulation); no AMX on this CPU".into()
            }
        };
        match self.refused() {
            Some(why) => format!("{line} ({why})"),
            None => line,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn offer(amx: bool, avx512_bf16: bool, onednn: bool, intel: bool) -> Offer {
        Offer {
            amx_cpu: amx,
            amx,
            avx512_bf16,
            avx512: avx512_bf16,
            onednn,
            intel,
        }
    }

    #[test]
    fn the_request_wins_when_usable_and_the_default_order_otherwise() {
        use Kernel::*;
        let kernel = |req, o| Backend::choose(req, o).kernel();
        // An AVX512-BF16 CPU without AMX or oneDNN: our kernel on AMD, the f32 GEMM
        // on Intel (where it is faster) unless asked for.
        let (amd, intel) = (
            offer(false, true, false, false),
            offer(false, true, false, true),
        );
        assert_eq!(kernel(None, amd), Avx512Bf16);
        assert_eq!(kernel(None, intel), F32);
        assert_eq!(kernel(Some(Avx512Bf16), intel), Avx512Bf16);
        assert_eq!(kernel(Some(F32), amd), F32, "bf16_kernel = f32");
        assert_eq!(kernel(Some(Amx), amd), Avx512Bf16, "unusable request");
        // A CPU without AVX512-BF16 never gets the kernel, even when asked for it.
        let plain = offer(false, false, false, false);
        assert_eq!(kernel(None, plain), F32);
        assert_eq!(kernel(Some(Avx512Bf16), plain), F32);
        // Our AMX kernel comes first where it runs, then oneDNN, on either vendor.
        for intel in [false, true] {
            let all = offer(true, true, true, intel);
            assert_eq!(kernel(None, all), Amx);
            assert_eq!(kernel(None, offer(false, true, true, intel)), OneDnn);
            assert_eq!(kernel(Some(OneDnn), all), OneDnn);
            assert_eq!(kernel(Some(Avx512Bf16), all), Avx512Bf16);
        }
    }

    #[test]
    fn what_follows_from_the_kernel() {
        let amd = offer(false, true, false, false);
        let avx = Backend::choose(None, amd);
        let f32 = Backend::choose(Some(Kernel::F32), amd);
        let amx = Backend::choose(None, offer(true, true, false, false));
        // Packs where the kernel reads them and the weights are not lent; a rounded
        // copy wherever the model does not pack; neither in f32.
        assert!(avx.packs_weights(true, false) && !avx.keeps_bf16_copy(true, false));
        assert!(!avx.packs_weights(true, true) && avx.keeps_bf16_copy(true, true));
        assert!(!f32.packs_weights(true, false) && f32.keeps_bf16_copy(true, false));
        assert!(!avx.packs_weights(false, false) && !avx.keeps_bf16_copy(false, false));
        assert_eq!(f32.bf16_copy_len(true, false, 7), 7);
        assert_eq!(avx.bf16_copy_len(true, false, 7), 0);
        // dwte in one product on AMX only, in bf16 only.
        assert_eq!(amx.dwte_block(true, 50_257), 50_257);
        assert_eq!(amx.dwte_block(false, 50_257), DWTE_BLOCK);
        assert_eq!(avx.dwte_block(true, 50_257), DWTE_BLOCK);
        // Attention's pair kernels need AVX512-BF16 and products off the f32 GEMM.
        assert!(avx.attention_pairs() && amx.attention_pairs());
        assert!(!f32.attention_pairs());
        assert!(!Backend::portable().attention_pairs());
        assert!(!Backend::choose(None, offer(false, false, false, false)).attention_pairs());
    }

    #[test]
    fn a_refused_request_is_said() {
        let plain = offer(false, false, false, false);
        let b = Backend::choose(Some(Kernel::Avx512Bf16), plain);
        assert_eq!(b.kernel(), Kernel::F32);
        let line = b.describe();
        assert!(line.contains("this CPU has no AVX512-BF16"), "{line}");
        assert!(Backend::choose(Some(Kernel::F32), plain)
            .refused()
            .is_none());
        let asked = Backend::choose(Some(Kernel::F32), plain).describe();
        assert!(asked.contains("as bf16_kernel = f32 asks"), "{asked}");
    }

    #[test]
    fn requests_are_named() {
        assert_eq!(Kernel::parse_request("auto"), Some(None));
        for (name, k) in Kernel::ALL {
            assert_eq!(Kernel::parse_request(name), Some(Some(k)));
            assert_eq!(k.name(), name);
            assert!(Kernel::REQUEST_NAMES.contains(&name));
        }
        assert_eq!(Kernel::parse_request("tpu"), None);
    }

    #[test]
    fn this_machines_offer_is_the_cpus() {
        let here = Offer::detect();
        assert_eq!(here.avx512_bf16, cpu::avx512_bf16());
        assert_eq!(here.amx, cpu::amx_permitted());
        assert!(here.usable(Kernel::F32));
        let b = Backend::detect(None);
        assert!(here.usable(b.kernel()));
        assert_eq!(
            Backend::with_kernel(Kernel::F32).map(|b| b.kernel()),
            Some(Kernel::F32)
        );
    }
}
