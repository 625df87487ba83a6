//! The Rust mirrors of the launch parameters against `params.h` as the host C++ compiler lays it
//! out: every struct's size and every field's offset must agree, or a kernel would read its
//! parameters from the wrong bytes.

use multilora_kernels::Emulator;
use multilora_kernels::params::{
    AddNormParams, BgmvExpandParams, BgmvShrinkParams, DecodeAttnParams, DecodeSplitParams, EmbedShrinkParams,
    ExpandParams, GreedyParams, KvWriteParams, RopeKvParams, ShrinkParams, SiluMulParams, Tile,
};

fn check(c: &[(String, usize)], name: &str, size: usize, fields: &[(&str, usize)], bytes: usize) {
    let get = |k: &str| c.iter().find(|(n, _)| n == k).map(|(_, v)| *v);
    assert_eq!(get(&format!("{name} size")), Some(size), "size of {name}");
    assert_eq!(bytes, size, "{name}::to_bytes must write exactly the struct");
    for (f, off) in fields {
        assert_eq!(get(&format!("{name}.{f}")), Some(*off), "offset of {name}.{f}");
    }
    let c_fields = c.iter().filter(|(n, _)| n.starts_with(&format!("{name}."))).count();
    assert_eq!(c_fields, fields.len(), "{name}: the header and the mirror have different fields");
}

macro_rules! check_struct {
    ($c:expr, $t:ty) => {
        check($c, <$t>::C_NAME, std::mem::size_of::<$t>(), <$t>::FIELDS, <$t>::zeroed().to_bytes().len())
    };
}

#[test]
fn rust_mirrors_match_the_c_header() {
    let Some(emu) = Emulator::for_tests() else { return };
    let c = emu.layout().unwrap();
    check_struct!(&c, Tile);
    check_struct!(&c, ShrinkParams);
    check_struct!(&c, ExpandParams);
    check_struct!(&c, EmbedShrinkParams);
    check_struct!(&c, DecodeAttnParams);
    check_struct!(&c, KvWriteParams);
    check_struct!(&c, BgmvShrinkParams);
    check_struct!(&c, BgmvExpandParams);
    check_struct!(&c, RopeKvParams);
    check_struct!(&c, AddNormParams);
    check_struct!(&c, SiluMulParams);
    check_struct!(&c, GreedyParams);
    check_struct!(&c, DecodeSplitParams);
}

#[test]
fn bytes_are_the_fields_in_order() {
    let t = Tile { slot: 1, seg: 2, start: 3, len: 4 };
    let b = t.to_bytes();
    assert_eq!(b, [1, 0, 0, 0, 2, 0, 0, 0, 3, 0, 0, 0, 4, 0, 0, 0]);
    let mut p = ShrinkParams::zeroed();
    p.x = 0x0102_0304_0506_0708;
    p.rank[1][0] = 0xabcd;
    let b = p.to_bytes();
    assert_eq!(&b[..8], &0x0102_0304_0506_0708u64.to_le_bytes());
    let off = ShrinkParams::FIELDS.iter().find(|f| f.0 == "rank").unwrap().1;
    assert_eq!(&b[off + 2 * multilora_kernels::params::MAX_SEGS..][..2], &[0xcd, 0xab]);
}
