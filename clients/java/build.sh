#!/usr/bin/env bash
# Builds the Java client offline with Maven against Debian 12's packaged artifacts
# (/usr/share/maven-repo: grpc-java 1.41.3, protobuf-java 3.21.12, netty 4.1.48, the Maven
# plugins; nothing is downloaded). OUT defaults to clients/java/target and gets
#   classes/, pagedserve-client-0.1.0.jar, classpath.txt (the runtime classpath),
#   native/libnetty_tcnative.so (Debian's OpenSSL binding under the name netty loads; TLS needs it),
#   bin/pagedserve-generate and bin/pagedserve-quickstart (run the examples
#   io.pagedserve.examples.Generate and .Quickstart).
#
#     clients/java/build.sh [OUT]
#     OUT/bin/pagedserve-generate --address 127.0.0.1:50051 "The capital of France is"
set -euo pipefail
here=$(cd "$(dirname "$0")" && pwd)
out=$(mkdir -p "${1:-$here/target}" && cd "${1:-$here/target}" && pwd)
mvn -B -q -Dstyle.color=never -s "$here/debian-settings.xml" -f "$here/pom.xml" -Pdebian \
    "-Dpagedserve.build.dir=$out" package
# Debian names the JNI library libnetty-tcnative.so; netty looks for libnetty_tcnative.so, and the
# library checks its own file name, so it is copied (not linked) under the expected name.
tcnative=$(ls /usr/lib/*/jni/libnetty-tcnative.so 2>/dev/null | head -1 || true)
mkdir -p "$out/native" "$out/bin"
if [ -n "$tcnative" ]; then
    cp "$tcnative" "$out/native/libnetty_tcnative.so"
else
    echo "java: libnetty-tcnative.so not found (apt-get install libnetty-tcnative-jni): TLS will not work" >&2
fi
for main in Generate Quickstart; do
    launcher=$out/bin/pagedserve-$(echo "$main" | tr '[:upper:]' '[:lower:]')
    cat > "$launcher" <<LAUNCHER
#!/bin/sh
exec java -Djava.library.path="$out/native" -cp "$out/classes:\$(cat "$out/classpath.txt")" io.pagedserve.examples.$main "\$@"
LAUNCHER
    chmod +x "$launcher"
done
echo "java: built $out/pagedserve-client-0.1.0.jar, $out/bin/pagedserve-generate and $out/bin/pagedserve-quickstart"
