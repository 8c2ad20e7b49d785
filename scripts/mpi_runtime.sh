#!/usr/bin/env bash
# Packs this host's Open MPI runtime (mpirun, its components and help files, and every shared
# library they and libmpi load that is not the C library's) into one relocatable folder, for a
# GPU host without MPI (the lent GPU machines have none): there, `source DIR/env.sh` puts it on
# PATH and LD_LIBRARY_PATH and points Open MPI's OPAL_PREFIX at it, so an `--features mpi`
# rackfill runs under `mpirun` (`scripts/gpu_session.sh` step `group`). Usage:
# `bash scripts/mpi_runtime.sh [DIR]` (default .gpu-bundle/mpi), then carry DIR.
set -euo pipefail
out=${1:-.gpu-bundle/mpi}
prefix=$(ompi_info --path prefix --parsable | cut -d: -f3)
pkglibdir=$(ompi_info --path pkglibdir --parsable | cut -d: -f3)
libdir=$(ompi_info --path libdir --parsable | cut -d: -f3)
pkgdatadir=$(ompi_info --path pkgdatadir --parsable | cut -d: -f3)
sysconfdir=$(ompi_info --path sysconfdir --parsable | cut -d: -f3)
rm -rf "$out"
root="$out/root"
mkdir -p "$root$prefix/bin" "$root$pkglibdir" "$root$libdir" "$root$pkgdatadir" "$out/lib" "$out/etc"
# The launcher (mpirun is orterun under other names) and the daemon it starts per host.
for exe in orterun orted; do cp -L "$(command -v $exe)" "$root$prefix/bin/"; done
ln -sf orterun "$root$prefix/bin/mpirun"
cp -L "$pkglibdir"/*.so "$root$pkglibdir/"
cp -L "$libdir"/lib*.so* "$root$libdir/" 2>/dev/null || true
cp -rL "$pkgdatadir"/. "$root$pkgdatadir/"
cp -L "$sysconfdir"/openmpi-mca-params.conf "$out/etc/"
# Every library the launcher, libmpi and the components load, but the C library's own.
for f in "$root$prefix"/bin/* "$root$pkglibdir"/*.so "$root$libdir"/*.so*; do
  ldd "$f" 2>/dev/null | awk '$3 ~ /^\// {print $3}'
done | sort -u | grep -vE '/(libc|libm|libdl|libpthread|librt|ld-linux[^/]*)\.so' | while read -r lib; do
  cp -L "$lib" "$out/lib/"
done
cat > "$out/env.sh" <<ENV
# Sourced on the GPU host: this folder's Open MPI runtime, relocated.
here=\$(cd "\$(dirname "\${BASH_SOURCE[0]}")" && pwd)
export OPAL_PREFIX=\$here/root$prefix
export OPAL_SYSCONFDIR=\$here/etc
export PATH=\$OPAL_PREFIX/bin:\$PATH
export PMIX_MCA_pcompress_base_silence_warning=1
export LD_LIBRARY_PATH=\$here/lib:\$here/root$libdir\${LD_LIBRARY_PATH:+:\$LD_LIBRARY_PATH}
ENV
du -sh "$out"
