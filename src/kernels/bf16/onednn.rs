//! The bf16 matmuls on oneDNN (Intel's deep-learning primitive library, Debian's
//! `libdnnl2` 2.6), behind the `onednn` cargo feature: bf16 × bf16 → f32 `matmul`
//! primitives, which run on AMX tiles where the CPU has them and on AVX512-BF16
//! (`vdpbf16ps`) where it has only that.
//!
//! Our operands are f32 buffers that hold bf16 values ([`Mat`] views, possibly
//! transposed). Each call copies them into bf16 buffers in the orientation they are
//! stored in (a transposed view stays a streaming copy; oneDNN reads it through
//! strides), rounding to nearest even (exact for bf16 values), and runs a primitive
//! made once per (m, n, k, operand strides, accumulate) and kept for the process:
//! a GPT-2 step has about a dozen distinct products. Accumulation (`dst +=`) is a
//! `sum` post-op. The weights are passed in the plain layout: a reorder to oneDNN's
//! blocked layout cost about as much as a product on the AVX512-BF16 CPU we
//! measured, and the packed product was not consistently faster (docs/PERFORMANCE.md,
//! "oneDNN").
//!
//! Threads: Debian's libdnnl uses OpenMP (libgomp). One call runs at a time (a lock
//! over the cached primitives and buffers), and before each the calling thread's
//! OpenMP team is sized to rayon's pool, so oneDNN's threads replace rayon's for the
//! duration of the product instead of adding to them (rayon's workers are idle:
//! our matmuls are called from outside parallel loops).
//!
//! Results are deterministic for a given thread count: a primitive splits the work
//! the same way every call.
//!
//! The FFI below declares the few C functions used, from `oneapi/dnnl/dnnl.h` 2.6;
//! the library is opened at run time (`load` says why), so building with the
//! feature needs no oneDNN, and a binary built with it runs where oneDNN is missing
//! (on the other kernels; `bench` and `train` print which ran).

use super::Bf16;
use crate::kernels::mat::{shapes_checked_and_trivial, Mat};
use rayon::prelude::*;
use std::collections::HashMap;
use std::ffi::{c_char, c_int, c_void, CStr};
use std::sync::{Mutex, OnceLock};

/// Declarations from oneDNN 2.6's C API (`dnnl.h`, `dnnl_types.h`).
#[allow(non_camel_case_types)]
mod ffi {
    use std::ffi::{c_float, c_int, c_void};

    pub type dnnl_status_t = c_int;
    pub const SUCCESS: dnnl_status_t = 0;
    /// `dnnl_data_type_t`.
    pub const BF16: c_int = 2;
    pub const F32: c_int = 3;
    /// `dnnl_format_tag_t`: plain row-major 2-D.
    pub const TAG_AB: c_int = 3;
    /// `dnnl_engine_kind_t`.
    pub const ENGINE_CPU: c_int = 1;
    /// `dnnl_stream_default_flags` (in-order).
    pub const STREAM_DEFAULT: u32 = 1;
    /// `dnnl_query_t`: the implementation's name.
    pub const QUERY_IMPL_INFO_STR: c_int = 8;
    /// `DNNL_ARG_*`.
    pub const ARG_SRC: c_int = 1;
    pub const ARG_DST: c_int = 17;
    pub const ARG_WEIGHTS: c_int = 33;

    pub type dnnl_engine_t = *mut c_void;
    pub type dnnl_stream_t = *mut c_void;
    pub type dnnl_primitive_desc_t = *mut c_void;
    pub type dnnl_primitive_t = *mut c_void;
    pub type dnnl_primitive_attr_t = *mut c_void;
    pub type dnnl_post_ops_t = *mut c_void;
    pub type dnnl_memory_t = *mut c_void;

    /// `dnnl_memory_desc_t`, only ever filled and read by the library through
    /// pointers: 696 bytes, 8-aligned in 2.6.3 (`sizeof`); twice that here.
    #[repr(C, align(8))]
    pub struct MemoryDesc(pub [u8; 1392]);
    /// `dnnl_matmul_desc_t`: 2,800 bytes, 8-aligned in 2.6.3; twice that here.
    #[repr(C, align(8))]
    pub struct MatmulDesc(pub [u8; 5600]);

    #[repr(C)]
    pub struct ExecArg {
        pub arg: c_int,
        pub memory: dnnl_memory_t,
    }

    /// Declares the functions used, as fields of [`Api`], and [`Api::load`], which
    /// looks each up in the loaded library.
    macro_rules! api {
        ($($name:ident($($arg:ident: $ty:ty),*) $(-> $ret:ty)?;)*) => {
            /// oneDNN's (and its OpenMP runtime's) entry points.
            pub struct Api {
                $(pub $name: unsafe extern "C" fn($($ty),*) $(-> $ret)?,)*
            }

            impl Api {
                /// Looks up every function in `lib`, naming the first one missing.
                ///
                /// # Safety
                /// `lib` must be a handle from `dlopen` of oneDNN 2.x, kept open for
                /// the process: the declarations above match its `dnnl.h`.
                pub unsafe fn load(lib: *mut c_void) -> Result<Api, String> {
                    Ok(Api {
                        $($name: {
                            let sym = concat!(stringify!($name), "\0");
                            let f = libc::dlsym(lib, sym.as_ptr().cast());
                            if f.is_null() {
                                return Err(format!("{} not found", stringify!($name)));
                            }
                            std::mem::transmute::<*mut c_void, unsafe extern "C" fn($($ty),*) $(-> $ret)?>(f)
                        },)*
                    })
                }
            }
        };
    }

    api! {
        dnnl_engine_create(e: *mut dnnl_engine_t, kind: c_int, index: usize) -> dnnl_status_t;
        dnnl_stream_create(s: *mut dnnl_stream_t, e: dnnl_engine_t, flags: u32) -> dnnl_status_t;
        dnnl_stream_wait(s: dnnl_stream_t) -> dnnl_status_t;
        dnnl_memory_desc_init_by_strides(
            md: *mut MemoryDesc,
            ndims: c_int,
            dims: *const i64,
            data_type: c_int,
            strides: *const i64
        ) -> dnnl_status_t;
        dnnl_memory_desc_init_by_tag(
            md: *mut MemoryDesc,
            ndims: c_int,
            dims: *const i64,
            data_type: c_int,
            tag: c_int
        ) -> dnnl_status_t;
        dnnl_matmul_desc_init(
            d: *mut MatmulDesc,
            src: *const MemoryDesc,
            weights: *const MemoryDesc,
            bias: *const MemoryDesc,
            dst: *const MemoryDesc
        ) -> dnnl_status_t;
        dnnl_primitive_attr_create(a: *mut dnnl_primitive_attr_t) -> dnnl_status_t;
        dnnl_primitive_attr_destroy(a: dnnl_primitive_attr_t) -> dnnl_status_t;
        dnnl_primitive_attr_set_post_ops(
            a: dnnl_primitive_attr_t,
            p: dnnl_post_ops_t
        ) -> dnnl_status_t;
        dnnl_post_ops_create(p: *mut dnnl_post_ops_t) -> dnnl_status_t;
        dnnl_post_ops_destroy(p: dnnl_post_ops_t) -> dnnl_status_t;
        dnnl_post_ops_append_sum(p: dnnl_post_ops_t, scale: c_float) -> dnnl_status_t;
        dnnl_primitive_desc_create(
            pd: *mut dnnl_primitive_desc_t,
            op_desc: *const c_void,
            attr: dnnl_primitive_attr_t,
            e: dnnl_engine_t,
            hint: dnnl_primitive_desc_t
        ) -> dnnl_status_t;
        dnnl_primitive_desc_query(
            pd: dnnl_primitive_desc_t,
            what: c_int,
            index: c_int,
            result: *mut c_void
        ) -> dnnl_status_t;
        dnnl_primitive_desc_destroy(pd: dnnl_primitive_desc_t) -> dnnl_status_t;
        dnnl_primitive_create(p: *mut dnnl_primitive_t, pd: dnnl_primitive_desc_t)
            -> dnnl_status_t;
        dnnl_primitive_execute(
            p: dnnl_primitive_t,
            s: dnnl_stream_t,
            nargs: c_int,
            args: *const ExecArg
        ) -> dnnl_status_t;
        dnnl_memory_create(
            m: *mut dnnl_memory_t,
            md: *const MemoryDesc,
            e: dnnl_engine_t,
            handle: *mut c_void
        ) -> dnnl_status_t;
        dnnl_memory_set_data_handle(m: dnnl_memory_t, handle: *mut c_void) -> dnnl_status_t;
        // From libgomp, which libdnnl loads: the OpenMP team size for parallel
        // regions the calling thread starts.
        omp_set_num_threads(n: c_int);
    }

    /// Panics naming the call when oneDNN reports an error: every call here is
    /// valid by construction, so a failure is a bug or a broken library.
    pub fn check(status: dnnl_status_t, what: &str) {
        assert_eq!(status, SUCCESS, "oneDNN {what} failed (status {status})");
    }
}

/// A matmul primitive for one (shape, strides, accumulate) and the memory objects it
/// reads and writes, whose data pointers are set before each run.
struct Primitive {
    prim: ffi::dnnl_primitive_t,
    src: ffi::dnnl_memory_t,
    weights: ffi::dnnl_memory_t,
    dst: ffi::dnnl_memory_t,
}

/// What identifies a primitive: m, n, k, A's and B's (row, col) strides in their
/// bf16 copies, and whether it accumulates.
type Key = (usize, usize, usize, [i64; 2], [i64; 2], bool);

/// The engine, stream, the primitives made so far and the bf16 operand copies.
struct State {
    engine: ffi::dnnl_engine_t,
    stream: ffi::dnnl_stream_t,
    prims: HashMap<Key, Primitive>,
    a16: Vec<Bf16>,
    b16: Vec<Bf16>,
}

// SAFETY: oneDNN engines, streams, primitives and memory objects may be used from
// any thread; the Mutex around the State lets one thread at a time use them.
unsafe impl Send for State {}

/// The library's state and the name of its bf16 matmul implementation on this CPU,
/// or `None` when the library is missing or its implementation here is not one on
/// bf16 hardware (see [`init`]).
fn state() -> Option<&'static (Mutex<State>, String)> {
    static S: OnceLock<Option<(Mutex<State>, String)>> = OnceLock::new();
    S.get_or_init(init).as_ref()
}

/// The library's soname (Debian's `libdnnl2`, 2.x).
const LIBRARY: &str = "libdnnl.so.2";

/// oneDNN's entry points, loaded once, or why they could not be.
fn loaded() -> &'static Result<ffi::Api, String> {
    static API: OnceLock<Result<ffi::Api, String>> = OnceLock::new();
    API.get_or_init(load)
}

/// The entry points; only called once [`state`] has loaded them.
fn api() -> &'static ffi::Api {
    loaded().as_ref().expect("oneDNN is used only once loaded")
}

/// Opens the library, first making its OpenMP threads sleep between products
/// (`OMP_WAIT_POLICY=passive`, unless the user set a policy): libgomp reads that
/// once, when it is loaded, and its default — spinning for a while after each
/// parallel region — kept a core busy while our rayon threads ran the passes
/// between matmuls on a 2-core machine (GPT-2 124M B 4 T 256 bf16, alternating
/// rounds on a loaded machine: docs/PERFORMANCE.md, "oneDNN"). That is why the
/// library is opened here, on first use, rather than linked.
fn load() -> Result<ffi::Api, String> {
    // (Setting the environment races only with C code reading it on another thread;
    // ours reads it through std, which locks, and this runs once, at the first
    // large bf16 product or the `bf16 matmuls:` line.)
    if std::env::var_os("OMP_WAIT_POLICY").is_none() {
        std::env::set_var("OMP_WAIT_POLICY", "passive");
    }
    let name = std::ffi::CString::new(LIBRARY).expect("no NUL in the name");
    // SAFETY: dlopen with a NUL-terminated name; the handle is never closed, so the
    // functions looked up in it stay valid for the process; Api::load's
    // declarations are those of oneDNN 2.x's dnnl.h.
    unsafe {
        let lib = libc::dlopen(name.as_ptr(), libc::RTLD_NOW | libc::RTLD_LOCAL);
        if lib.is_null() {
            return Err(format!("{LIBRARY} not found (apt-get install libdnnl2)"));
        }
        ffi::Api::load(lib)
    }
}

/// Makes the engine and stream and checks which implementation oneDNN picks here.
fn init() -> Option<(Mutex<State>, String)> {
    loaded().as_ref().ok()?;
    let (mut engine, mut stream) = (std::ptr::null_mut(), std::ptr::null_mut());
    // SAFETY: out-pointers to locals; the engine outlives the stream (both are kept
    // for the process).
    unsafe {
        if (api().dnnl_engine_create)(&mut engine, ffi::ENGINE_CPU, 0) != ffi::SUCCESS {
            return None;
        }
        ffi::check(
            (api().dnnl_stream_create)(&mut stream, engine, ffi::STREAM_DEFAULT),
            "stream_create",
        );
    }
    // The implementation oneDNN picks for a bf16 matmul. Only those on bf16 hardware
    // (AMX, AVX512-BF16) are used: they are the ones measured faster than the f32
    // GEMM; a reference (`ref:`) one is orders of magnitude slower, and emulated bf16
    // on plain AVX-512 or AVX2 was not measured.
    let pd = primitive_desc(engine, (64, 64, 64, [64, 1], [64, 1], false))?;
    let name = impl_name(pd);
    // SAFETY: `pd` was created above and is not used after this.
    unsafe { (api().dnnl_primitive_desc_destroy)(pd) };
    if !(name.contains("amx") || name.contains("avx512_core_bf16")) {
        return None;
    }
    let state = State {
        engine,
        stream,
        prims: HashMap::new(),
        a16: Vec::new(),
        b16: Vec::new(),
    };
    Some((Mutex::new(state), name))
}

/// Whether oneDNN has a fast bf16 matmul on this CPU (decided once).
pub fn available() -> bool {
    state().is_some()
}

/// Why oneDNN is not [`available`], if it is not.
pub fn unavailable_reason() -> Option<String> {
    match (loaded(), available()) {
        (_, true) => None,
        (Err(e), _) => Some(e.clone()),
        (Ok(_), false) => {
            Some("its bf16 matmul on this CPU is not an AMX or AVX512-BF16 one".into())
        }
    }
}

/// oneDNN's name for the bf16 matmul implementation it runs here (e.g.
/// `brg:avx512_core_bf16`, `brg:avx512_core_amx_bf16`), when [`available`].
pub fn implementation() -> Option<&'static str> {
    state().map(|(_, name)| name.as_str())
}

/// A bf16 × bf16 → f32 matmul primitive descriptor for `key`, or `None` when oneDNN
/// has no implementation for it.
fn primitive_desc(engine: ffi::dnnl_engine_t, key: Key) -> Option<ffi::dnnl_primitive_desc_t> {
    let (m, n, k, sa, sb, accumulate) = key;
    let (m, n, k) = (m as i64, n as i64, k as i64);
    let mut a_md = ffi::MemoryDesc([0; 1392]);
    let mut b_md = ffi::MemoryDesc([0; 1392]);
    let mut c_md = ffi::MemoryDesc([0; 1392]);
    let mut desc = ffi::MatmulDesc([0; 5600]);
    let (mut attr, mut post_ops, mut pd) = (
        std::ptr::null_mut(),
        std::ptr::null_mut(),
        std::ptr::null_mut(),
    );
    // SAFETY: the descriptors are buffers larger than the library's structs, written
    // only by it; dims and strides point to two i64 each (ndims = 2); the attribute
    // and post-ops are destroyed after the descriptor has copied them.
    unsafe {
        let md = |md: *mut ffi::MemoryDesc, dims: [i64; 2], strides: [i64; 2]| {
            let s = (api().dnnl_memory_desc_init_by_strides)(
                md,
                2,
                dims.as_ptr(),
                ffi::BF16,
                strides.as_ptr(),
            );
            ffi::check(s, "memory_desc_init_by_strides");
        };
        md(&mut a_md, [m, k], sa);
        md(&mut b_md, [k, n], sb);
        let s = (api().dnnl_memory_desc_init_by_tag)(
            &mut c_md,
            2,
            [m, n].as_ptr(),
            ffi::F32,
            ffi::TAG_AB,
        );
        ffi::check(s, "memory_desc_init_by_tag");
        let s = (api().dnnl_matmul_desc_init)(&mut desc, &a_md, &b_md, std::ptr::null(), &c_md);
        ffi::check(s, "matmul_desc_init");
        ffi::check((api().dnnl_primitive_attr_create)(&mut attr), "attr_create");
        if accumulate {
            ffi::check(
                (api().dnnl_post_ops_create)(&mut post_ops),
                "post_ops_create",
            );
            ffi::check(
                (api().dnnl_post_ops_append_sum)(post_ops, 1.0),
                "append_sum",
            );
            let s = (api().dnnl_primitive_attr_set_post_ops)(attr, post_ops);
            ffi::check(s, "attr_set_post_ops");
        }
        let status = (api().dnnl_primitive_desc_create)(
            &mut pd,
            (&desc as *const ffi::MatmulDesc).cast(),
            attr,
            engine,
            std::ptr::null_mut(),
        );
        if !post_ops.is_null() {
            (api().dnnl_post_ops_destroy)(post_ops);
        }
        (api().dnnl_primitive_attr_destroy)(attr);
        (status == ffi::SUCCESS).then_some(pd)
    }
}

/// The implementation name of a primitive descriptor.
fn impl_name(pd: ffi::dnnl_primitive_desc_t) -> String {
    let mut name: *const c_char = std::ptr::null();
    // SAFETY: the query writes a pointer to a NUL-terminated string owned by `pd`,
    // copied before `pd` goes away.
    unsafe {
        let s = (api().dnnl_primitive_desc_query)(
            pd,
            ffi::QUERY_IMPL_INFO_STR,
            0,
            (&mut name as *mut *const c_char).cast(),
        );
        ffi::check(s, "primitive_desc_query(impl_info_str)");
        CStr::from_ptr(name).to_string_lossy().into_owned()
    }
}

impl Primitive {
    fn new(engine: ffi::dnnl_engine_t, key: Key) -> Primitive {
        let pd = primitive_desc(engine, key)
            .unwrap_or_else(|| panic!("oneDNN has no bf16 matmul for {key:?}"));
        let mut p = Primitive {
            prim: std::ptr::null_mut(),
            src: std::ptr::null_mut(),
            weights: std::ptr::null_mut(),
            dst: std::ptr::null_mut(),
        };
        // SAFETY: `pd` is valid until destroyed at the end; the memory descriptors
        // are copied by dnnl_memory_create; a null handle means "no data yet" (set
        // before every run).
        unsafe {
            ffi::check(
                (api().dnnl_primitive_create)(&mut p.prim, pd),
                "primitive_create",
            );
            for (mem, which) in [
                (&mut p.src, ffi::ARG_SRC),
                (&mut p.weights, ffi::ARG_WEIGHTS),
                (&mut p.dst, ffi::ARG_DST),
            ] {
                let md = exec_arg_md(pd, which);
                let s = (api().dnnl_memory_create)(mem, md, engine, std::ptr::null_mut());
                ffi::check(s, "memory_create");
            }
            (api().dnnl_primitive_desc_destroy)(pd);
        }
        p
    }
}

/// The memory descriptor `pd` expects for execution argument `arg`.
///
/// # Safety
/// `pd` must be a valid primitive descriptor; the result lives as long as it.
unsafe fn exec_arg_md(pd: ffi::dnnl_primitive_desc_t, arg: c_int) -> *const ffi::MemoryDesc {
    const QUERY_EXEC_ARG_MD: c_int = 255;
    let mut md: *const ffi::MemoryDesc = std::ptr::null();
    let s = (api().dnnl_primitive_desc_query)(
        pd,
        QUERY_EXEC_ARG_MD,
        arg,
        (&mut md as *mut *const ffi::MemoryDesc).cast(),
    );
    ffi::check(s, "primitive_desc_query(exec_arg_md)");
    md
}

/// Copies `m` into `buf` as bf16 (rounded to nearest even), keeping the orientation
/// it is stored in; returns the copy's (row, col) strides.
fn to_bf16(buf: &mut Vec<Bf16>, m: Mat) -> [i64; 2] {
    let (rows, cols) = (m.rows, m.cols);
    buf.resize(rows * cols, Bf16::default());
    let conv = |d: &mut [Bf16], s: &[f32]| {
        d.iter_mut()
            .zip(s)
            .for_each(|(d, &s)| *d = Bf16::from_f32(s))
    };
    if m.cs == 1 {
        // Row-major (possibly a column range of a wider matrix).
        buf.par_chunks_mut(cols)
            .enumerate()
            .for_each(|(i, d)| conv(d, &m.data[i * m.rs..i * m.rs + cols]));
        [cols as i64, 1]
    } else if m.rs == 1 {
        // A transposed view: columns are contiguous.
        buf.par_chunks_mut(rows)
            .enumerate()
            .for_each(|(j, d)| conv(d, &m.data[j * m.cs..j * m.cs + rows]));
        [1, rows as i64]
    } else {
        buf.par_chunks_mut(cols).enumerate().for_each(|(i, d)| {
            for (j, d) in d.iter_mut().enumerate() {
                *d = Bf16::from_f32(m.data[i * m.rs + j * m.cs]);
            }
        });
        [cols as i64, 1]
    }
}

/// `dst = a · b` (or `dst += a · b` when `accumulate`), dst dense row-major `m × n`,
/// on oneDNN's bf16 matmul (operands rounded to bf16, f32 accumulation). Panics
/// when oneDNN is not [`available`].
pub fn matmul(dst: &mut [f32], a: Mat, b: Mat, accumulate: bool) {
    if shapes_checked_and_trivial(dst, a, b, accumulate) {
        return;
    }
    let (m, k, n) = (a.rows, a.cols, b.cols);
    let (lock, _) = state().expect("oneDNN has no fast bf16 matmul on this CPU");
    let mut guard = lock.lock().unwrap_or_else(|e| e.into_inner());
    let st = &mut *guard;
    let sa = to_bf16(&mut st.a16, a);
    let sb = to_bf16(&mut st.b16, b);
    let engine = st.engine;
    let p = st
        .prims
        .entry((m, n, k, sa, sb, accumulate))
        .or_insert_with_key(|&key| Primitive::new(engine, key));
    // SAFETY: the memory objects describe exactly the bf16 copies (m × k and k × n
    // with the strides returned by `to_bf16`) and dst (m × n, f32, row-major), which
    // stay borrowed until the stream has finished; the primitive only reads a16/b16.
    unsafe {
        for (mem, ptr) in [
            (p.src, st.a16.as_mut_ptr() as *mut c_void),
            (p.weights, st.b16.as_mut_ptr() as *mut c_void),
            (p.dst, dst.as_mut_ptr() as *mut c_void),
        ] {
            ffi::check(
                (api().dnnl_memory_set_data_handle)(mem, ptr),
                "set_data_handle",
            );
        }
        let args = [
            ffi::ExecArg {
                arg: ffi::ARG_SRC,
                memory: p.src,
            },
            ffi::ExecArg {
                arg: ffi::ARG_WEIGHTS,
                memory: p.weights,
            },
            ffi::ExecArg {
                arg: ffi::ARG_DST,
                memory: p.dst,
            },
        ];
        (api().omp_set_num_threads)(rayon::current_num_threads() as c_int);
        let s = (api().dnnl_primitive_execute)(p.prim, st.stream, 3, args.as_ptr());
        ffi::check(s, "primitive_execute");
        ffi::check((api().dnnl_stream_wait)(st.stream), "stream_wait");
    }
}

#[cfg(test)]
/// Whether oneDNN can be tested here; CI sets `NANOGPT_EXPECT_ONEDNN` on CPUs
/// with bf16 hardware, where skipping would hide a broken build.
pub(crate) fn testable() -> bool {
    if !available() {
        let why = loaded().as_ref().err().map_or("no fast bf16 matmul", |e| e);
        assert!(
            !crate::tuning::env::get().expect_onednn,
            "NANOGPT_EXPECT_ONEDNN is set but oneDNN is not usable: {why}"
        );
        eprintln!("oneDNN not tested: {why}");
    }
    available()
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::kernels::bf16::testcases::*;
    use crate::kernels::mat::matmul as f32_gemm;
    use crate::kernels::testutil::*;

    #[test]
    fn onednn_matches_an_f64_reference_on_odd_shapes() {
        if !testable() {
            return;
        }
        odd_shapes(matmul);
    }

    #[test]
    fn views_with_offsets_and_strides_are_read_right() {
        if !testable() {
            return;
        }
        strided_views(matmul);
    }

    #[test]
    fn non_bf16_inputs_are_rounded_to_nearest_even() {
        if !testable() {
            return;
        }
        non_bf16_inputs_round(matmul);
    }

    #[test]
    fn an_empty_inner_dimension_gives_zero_or_leaves_dst() {
        empty_inner_dimension(matmul);
    }

    #[test]
    fn repeats_are_bit_identical_and_reuse_the_primitive() {
        if !testable() {
            return;
        }
        let (m, k, n) = (130, 300, 170);
        let (a, b) = (rounded(m * k, 6), rounded(k * n, 7));
        let [am, bm] = views(&a, &b, [m, k, n], [false, true]);
        let run = || {
            let mut out = rand_vec(m * n, 8);
            matmul(&mut out, am, bm, true);
            out
        };
        let first = run();
        // A row-major, B transposed (its columns contiguous).
        let key = (m, n, k, [k as i64, 1], [1, k as i64], true);
        // (Other tests may add primitives meanwhile: only this product's is checked.)
        let made = || state().unwrap().0.lock().unwrap().prims[&key].prim as usize;
        let before = made();
        assert_eq!(first, run());
        assert_eq!(made(), before, "a second primitive for the same product");
    }

    /// Timing, not correctness: `cargo test --release --features onednn --lib
    /// onednn_speed -- --ignored --nocapture`. Alternates the f32 GEMM and oneDNN
    /// (operand copies included) on GPT-2 124M's products (B·T = 1024).
    #[test]
    #[ignore]
    fn onednn_speed() {
        if !testable() {
            return;
        }
        println!("oneDNN implementation: {}", implementation().unwrap_or("?"));
        // The classifier's dwte as one product over the whole vocabulary.
        let dwte = ("cls dwte dlᵀ·x", 50304, 256, 768, true, false);
        let shapes = [&GPT2_PRODUCTS[..], &[dwte]].concat();
        for (name, m, k, n, ta, tb) in shapes {
            let (a, b) = (rounded(m * k, 1), rounded(k * n, 2));
            let [am, bm] = views(&a, &b, [m, k, n], [ta, tb]);
            let mut out = vec![0.0; m * n];
            matmul(&mut out, am, bm, false);
            let (mut a16, mut b16) = (Vec::new(), Vec::new());
            let mut t = [Vec::new(), Vec::new(), Vec::new()];
            for _ in 0..5 {
                let s = std::time::Instant::now();
                f32_gemm(&mut out, am, bm, false);
                t[0].push(s.elapsed().as_secs_f64());
                let s = std::time::Instant::now();
                matmul(&mut out, am, bm, false);
                t[1].push(s.elapsed().as_secs_f64());
                // The operand copies alone (their share of the oneDNN call).
                let s = std::time::Instant::now();
                to_bf16(&mut a16, am);
                to_bf16(&mut b16, bm);
                t[2].push(s.elapsed().as_secs_f64());
            }
            let median = |t: &mut Vec<f64>| {
                t.sort_by(f64::total_cmp);
                t[t.len() / 2]
            };
            let flop = 2.0 * (m * n * k) as f64 / 1e9;
            let (f32, dnnl) = (median(&mut t[0]), median(&mut t[1]));
            let copies = median(&mut t[2]);
            println!(
                "{name:<16} {m:>6}×{k:>6}×{n:>6}: f32 GEMM {:>6.1}, oneDNN {:>6.1} GFLOP/s \
                 ({:.0} % of it in operand copies; medians of 5, alternating)",
                flop / f32,
                flop / dnnl,
                100.0 * copies / dnnl
            );
        }
    }
}
