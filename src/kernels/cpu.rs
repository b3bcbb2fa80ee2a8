//! What this CPU offers the kernels, each asked once: the facts the bf16 back-end is
//! chosen from, and that the kernels check before running their instructions.

use std::sync::OnceLock;

/// Whether this CPU has AVX512-BF16 (and AVX-512 F), checked once.
pub fn avx512_bf16() -> bool {
    static OK: OnceLock<bool> = OnceLock::new();
    *OK.get_or_init(|| {
        #[cfg(target_arch = "x86_64")]
        {
            is_x86_feature_detected!("avx512f") && is_x86_feature_detected!("avx512bf16")
        }
        #[cfg(not(target_arch = "x86_64"))]
        false
    })
}

/// Whether this CPU has AMX-TILE and AMX-BF16 and the process may use the tiles
/// (asked of the kernel once, the first time this is called).
pub fn amx_permitted() -> bool {
    static OK: OnceLock<bool> = OnceLock::new();
    *OK.get_or_init(|| has_amx() && request_amx_permission())
}

/// CPUID leaf 7: EDX bit 22 is AMX-BF16, bit 24 AMX-TILE.
pub fn has_amx() -> bool {
    #[cfg(target_arch = "x86_64")]
    {
        // Leaf 7 exists when the maximum basic leaf (leaf 0's EAX) is at least 7.
        if std::arch::x86_64::__cpuid(0).eax < 7 {
            return false;
        }
        let edx = std::arch::x86_64::__cpuid_count(7, 0).edx;
        edx & (1 << 22) != 0 && edx & (1 << 24) != 0
    }
    #[cfg(not(target_arch = "x86_64"))]
    false
}

/// Asks Linux for the tile-data state component for this process
/// (`arch_prctl(ARCH_REQ_XCOMP_PERM, XFEATURE_XTILEDATA)`; the kernel grants it to
/// the whole process).
fn request_amx_permission() -> bool {
    #[cfg(all(target_arch = "x86_64", target_os = "linux"))]
    {
        const ARCH_REQ_XCOMP_PERM: libc::c_long = 0x1023;
        const XFEATURE_XTILEDATA: libc::c_long = 18;
        // SAFETY: arch_prctl with these arguments only changes which xsave features the
        // process may use; it reads and writes no memory of ours.
        let r = unsafe {
            libc::syscall(
                libc::SYS_arch_prctl,
                ARCH_REQ_XCOMP_PERM,
                XFEATURE_XTILEDATA,
            )
        };
        r == 0
    }
    #[cfg(not(all(target_arch = "x86_64", target_os = "linux")))]
    false
}

/// Whether this is an Intel CPU (CPUID's vendor string).
pub fn intel() -> bool {
    #[cfg(target_arch = "x86_64")]
    {
        // SAFETY: CPUID leaf 0 exists on every x86-64 CPU and only reads registers.
        #[allow(unused_unsafe)]
        let id = unsafe { std::arch::x86_64::__cpuid(0) };
        let bytes = [id.ebx, id.edx, id.ecx].map(u32::to_le_bytes).concat();
        bytes == *b"GenuineIntel"
    }
    #[cfg(not(target_arch = "x86_64"))]
    false
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The vendor string is read as CPUID gives it: this machine's `/proc/cpuinfo`
    /// says the same.
    #[test]
    fn the_vendor_is_cpuids() {
        let cpuinfo = std::fs::read_to_string("/proc/cpuinfo").unwrap_or_default();
        if cpuinfo.contains("vendor_id") {
            assert_eq!(intel(), cpuinfo.contains("GenuineIntel"));
        }
    }

    /// The features agree with what the kernel tells `/proc/cpuinfo`.
    #[test]
    fn the_features_are_the_kernels() {
        let cpuinfo = std::fs::read_to_string("/proc/cpuinfo").unwrap_or_default();
        let Some(flags) = cpuinfo.lines().find(|l| l.starts_with("flags")) else {
            return;
        };
        let has = |f: &str| flags.split_whitespace().any(|w| w == f);
        assert_eq!(avx512_bf16(), has("avx512f") && has("avx512_bf16"));
        assert_eq!(has_amx(), has("amx_bf16") && has("amx_tile"));
        assert!(!amx_permitted() || has_amx());
    }
}
