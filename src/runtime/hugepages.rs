//! Asks the kernel to back large weight buffers with 2 MiB pages. Decode streams gigabytes of
//! weights per token; with 4 KiB pages every 4 KiB read is a TLB miss and loading faults in
//! half a million pages. Advisory only: where the kernel says no, nothing changes.

/// Advises huge pages for the 2 MiB-aligned part of `buf`. Call it before first touching a
/// freshly allocated (zeroed, untouched) buffer so that the first faults map huge pages.
pub fn advise<T>(buf: &mut [T]) {
    #[cfg(target_os = "linux")]
    {
        const HUGE: usize = 2 << 20;
        let start = buf.as_mut_ptr() as usize;
        let end = start + std::mem::size_of_val(buf);
        let aligned = start.next_multiple_of(HUGE);
        if end > aligned + HUGE {
            let len = (end - aligned) / HUGE * HUGE;
            // SAFETY: [aligned, aligned + len) lies inside `buf`, which this call borrows
            // mutably; MADV_HUGEPAGE changes how pages are backed, never their contents.
            unsafe {
                libc::madvise(aligned as *mut libc::c_void, len, libc::MADV_HUGEPAGE);
            }
        }
    }
    #[cfg(not(target_os = "linux"))]
    let _ = buf;
}
