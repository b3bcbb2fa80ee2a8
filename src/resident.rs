//! Which pages of a buffer are resident: memory given back while keeping the buffer
//! (ZeRO-3 holds parameters and gradients in full-size arenas of which only the
//! pieces in use are resident; loaders drop a mapped weight file's pages once they
//! are copied), and huge pages asked for where buffers are filled whole. The model,
//! the loaders and the data-parallel code use it; it uses none of them.

use std::ops::Range;

/// Makes `buf[range]` read as zeros and hands the whole memory pages inside it back
/// to the operating system (`madvise(MADV_DONTNEED)`); the kernel maps fresh zero
/// pages on the next write, so the buffer keeps its length and address. The parts
/// of `range` on pages shared with the rest of `buf` are zeroed by hand.
pub fn release(buf: &mut [f32], range: Range<usize>) {
    let part = &mut buf[range];
    let (start, end) = whole_pages(part.as_ptr() as usize, part.len() * 4, page_size());
    if start >= end || !madvise_dontneed(start, end - start) {
        part.fill(0.0);
        return;
    }
    let base = part.as_ptr() as usize;
    let (head, rest) = part.split_at_mut((start - base) / 4);
    head.fill(0.0);
    rest[(end - start) / 4..].fill(0.0);
}

/// Drops the pages of `bytes`, a part of the read-only file mapping `map`, from this
/// process's memory once they have been copied out: loaders call it after each
/// tensor, so that a model being loaded is held once (in its arena), not twice
/// (arena and mapped file). Reading `bytes` again later is correct, only slower:
/// the pages come back from the file. Outside `map`, or where the system refuses,
/// nothing happens.
pub fn release_mapped(map: &memmap2::Mmap, bytes: &[u8]) {
    let start = (bytes.as_ptr() as usize).wrapping_sub(map.as_ptr() as usize);
    if bytes.is_empty() || start > map.len() || bytes.len() > map.len() - start {
        return;
    }
    #[cfg(unix)]
    // SAFETY: `map` is a read-only, private mapping of a file that is never written
    // through it, so MADV_DONTNEED drops nothing that the file does not hold: a
    // later read of these pages faults them in again with the same contents.
    // (memmap2 rounds the range out to whole pages.)
    let _ = unsafe {
        map.unchecked_advise_range(memmap2::UncheckedAdvice::DontNeed, start, bytes.len())
    };
}

/// Asks the kernel to back `buf` with transparent huge pages (2 MiB on x86-64) where
/// it faults memory in (`madvise(MADV_HUGEPAGE)`), for large buffers written in
/// whole: those of which ZeRO-3 releases and refills large ranges every pass, and a
/// decoder's fresh bf16 weight copy. One fault per huge page instead of one per 4 KiB
/// page, which made ZeRO-3's refill cost several times a plain copy. What [`release`]
/// gives back stays given back: the kernel splits a huge page that a released range
/// covers only in part. Advice only: false where refused (THP off, not Linux) or
/// turned off with `NANOGPT_ZERO3_HUGE_PAGES=0` (to measure; it covers both uses).
pub fn prefer_huge_pages<T>(buf: &[T]) -> bool {
    if !crate::tuning::get().huge_pages {
        return false;
    }
    let bytes = std::mem::size_of_val(buf);
    let (start, end) = whole_pages(buf.as_ptr() as usize, bytes, page_size());
    start < end && madvise_hugepage(start, end - start)
}

/// `madvise(addr, len, MADV_HUGEPAGE)`; false where it failed or is not available.
fn madvise_hugepage(addr: usize, len: usize) -> bool {
    #[cfg(target_os = "linux")]
    {
        // SAFETY: `addr..addr + len` are whole pages inside a slice the caller holds,
        // mapped private anonymous memory; MADV_HUGEPAGE changes only how the kernel
        // backs them on later faults, never their contents.
        unsafe { libc::madvise(addr as *mut libc::c_void, len, libc::MADV_HUGEPAGE) == 0 }
    }
    #[cfg(not(target_os = "linux"))]
    {
        let _ = (addr, len);
        false
    }
}

/// The page-aligned addresses `start..end` of the whole pages inside `len` bytes at
/// `addr` (`start >= end`: none).
fn whole_pages(addr: usize, len: usize, page: usize) -> (usize, usize) {
    (addr.next_multiple_of(page), (addr + len) / page * page)
}

fn page_size() -> usize {
    #[cfg(target_os = "linux")]
    {
        // SAFETY: sysconf only reads a system setting.
        let n = unsafe { libc::sysconf(libc::_SC_PAGESIZE) };
        if n > 0 {
            return n as usize;
        }
    }
    4096
}

/// `madvise(addr, len, MADV_DONTNEED)`; false where it failed or is not available.
fn madvise_dontneed(addr: usize, len: usize) -> bool {
    #[cfg(target_os = "linux")]
    {
        // SAFETY: `addr..addr + len` is made of whole pages inside a `&mut [f32]` the
        // caller holds, from Rust's global allocator (malloc), i.e. private anonymous
        // memory: after MADV_DONTNEED those pages read as zeros, which is a valid
        // f32 value and what the caller asked for; no other reference to them exists.
        unsafe { libc::madvise(addr as *mut libc::c_void, len, libc::MADV_DONTNEED) == 0 }
    }
    #[cfg(not(target_os = "linux"))]
    {
        let _ = (addr, len);
        false
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn released_ranges_read_zero_and_the_rest_is_kept() {
        let n = 3 << 20; // 12 MiB
        let mut buf: Vec<f32> = (0..n).map(|i| i as f32 + 1.0).collect();
        let range = 1000..n - 777;
        release(&mut buf, range.clone());
        for (i, &x) in buf.iter().enumerate() {
            let want = if range.contains(&i) {
                0.0
            } else {
                i as f32 + 1.0
            };
            assert_eq!(x, want, "at {i}");
        }
        // A range inside one page: zeroed by hand.
        release(&mut buf, 5..9);
        assert_eq!(&buf[4..10], &[5.0, 0.0, 0.0, 0.0, 0.0, 10.0]);
        // Writable again afterwards.
        buf[range.start + 5] = 2.0;
        assert_eq!(buf[range.start + 5], 2.0);
    }

    /// Resident pages among the whole pages of `buf` (`mincore`).
    #[cfg(target_os = "linux")]
    fn resident_pages(buf: &[f32]) -> usize {
        let (start, end) = whole_pages(buf.as_ptr() as usize, buf.len() * 4, page_size());
        let mut vec = vec![0u8; (end - start) / page_size()];
        // SAFETY: `start..end` are whole pages of `buf`, mapped; `vec` has one byte
        // per page, as mincore writes.
        let rc =
            unsafe { libc::mincore(start as *mut libc::c_void, end - start, vec.as_mut_ptr()) };
        assert_eq!(rc, 0, "mincore");
        vec.iter().filter(|&&b| b & 1 == 1).count()
    }

    #[test]
    #[cfg(target_os = "linux")]
    fn released_pages_leave_the_resident_set() {
        let n = 16 << 20; // 64 MiB of f32
        let mut buf = vec![1.0f32; n];
        let pages = resident_pages(&buf);
        assert!(pages * page_size() >= (60 << 20), "{pages} pages resident");
        release(&mut buf, 0..n);
        assert_eq!(resident_pages(&buf), 0, "every whole page released");
        // (Reading them maps the kernel's shared zero page: no memory.)
        assert!(buf.iter().all(|&x| x == 0.0));
    }

    /// Whether the kernel backs `MADV_HUGEPAGE` memory with huge pages (THP set to
    /// `always` or `madvise`).
    #[cfg(target_os = "linux")]
    fn huge_pages_on_advice() -> bool {
        let mode = std::fs::read_to_string("/sys/kernel/mm/transparent_hugepage/enabled");
        mode.is_ok_and(|m| m.contains("[always]") || m.contains("[madvise]"))
    }

    #[test]
    #[cfg(target_os = "linux")]
    fn advised_buffers_fault_in_whole_huge_pages_and_still_release() {
        if !huge_pages_on_advice() || !crate::tuning::get().huge_pages {
            eprintln!("transparent huge pages off here: nothing to check");
            return;
        }
        let n = 16 << 20; // 64 MiB of f32, not touched yet
        let mut buf = vec![0.0f32; n];
        assert!(prefer_huge_pages(&buf));
        let huge = 2 << 20;
        // One float written in the middle of an aligned 2 MiB extent brings in the
        // whole extent: 512 pages of 4 KiB (4 KiB pages: one).
        let at = (buf.as_ptr() as usize + 8 * huge).next_multiple_of(huge) + huge / 2;
        let i = (at - buf.as_ptr() as usize) / 4;
        buf[i] = 1.0;
        let pages = resident_pages(&buf);
        assert!(pages * page_size() >= huge, "{pages} pages resident");
        // Released, a part of that huge page reads zero and leaves the resident set;
        // the rest keeps its values.
        release(&mut buf, i - 4096..i + 1);
        assert!(resident_pages(&buf) < pages, "a part released");
        assert_eq!((buf[i], buf[i - 4096]), (0.0, 0.0));
        buf[i + 1] = 3.0;
        release(&mut buf, 0..i + 1);
        assert_eq!(buf[i + 1], 3.0);
        assert!(buf[..i + 1].iter().all(|&x| x == 0.0));
    }

    #[test]
    fn whole_pages_are_inside() {
        assert_eq!(whole_pages(4096, 8192, 4096), (4096, 12288));
        assert_eq!(whole_pages(4100, 8192, 4096), (8192, 12288));
        let (s, e) = whole_pages(4100, 100, 4096);
        assert!(s >= e);
    }
}
