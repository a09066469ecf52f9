// swift-tools-version:6.0
// TreegraftKit: a Swift client for `treegraft serve` (streamed text with each token's
// provenance) and a launcher for it. Foundation only; sources and tests live under swift/
// (a top-level Tests/ beside tests/ would collide on a case-insensitive disk).
import PackageDescription

let package = Package(
    name: "TreegraftKit",
    platforms: [.macOS(.v13)],
    products: [
        .library(name: "TreegraftKit", targets: ["TreegraftKit"]),
        .executable(name: "treegraft-chat", targets: ["TreegraftChat"]),
    ],
    targets: [
        .target(name: "TreegraftKit", path: "swift/Sources/TreegraftKit"),
        .executableTarget(name: "TreegraftChat", dependencies: ["TreegraftKit"],
                          path: "swift/Examples/TreegraftChat"),
        .executableTarget(name: "LaunchProbe", dependencies: ["TreegraftKit"],
                          path: "swift/Tests/LaunchProbe"),
        .testTarget(name: "TreegraftKitTests",
                    dependencies: ["TreegraftKit", "LaunchProbe", "TreegraftChat"],
                    path: "swift/Tests/TreegraftKitTests"),
    ]
)
