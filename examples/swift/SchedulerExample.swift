// Using the exported TreeGraft scheduler (Scheduler.mlpackage) from a macOS app.
//
// Export it with `treegraft_mlx.coreml.export_coreml(artifact_dir, "Scheduler.mlpackage")`.
// The model takes "features" (1 x 17 float32, in the order listed in its "features"
// metadata) and returns "value" (1 x 1 float32): the predicted value of letting the strong
// drafter expand the next tree layer. The runtime calls it iff value > 0 and fewer than b0
// calls were made this step; b0 is stored in the model's metadata.
//
// Not compiled or run in this repository (it is developed on Linux); see README.md.

import CoreML
import Foundation

@available(macOS 13.0, *)
final class TreeGraftScheduler {
    static let featureCount = 17

    private let model: MLModel
    let b0: Int
    let featureNames: [String]

    /// Compiles the .mlpackage (once per launch here; cache the compiled .mlmodelc in
    /// Application Support in a real app) and reads b0 and the feature order from metadata.
    init(packageURL: URL) async throws {
        let compiledURL = try await MLModel.compileModel(at: packageURL)
        let config = MLModelConfiguration()
        config.computeUnits = .cpuOnly  // a 17-64-32-1 MLP gains nothing from GPU/ANE dispatch
        model = try MLModel(contentsOf: compiledURL, configuration: config)

        let meta = model.modelDescription.metadata[.creatorDefinedKey] as? [String: String] ?? [:]
        b0 = Int(meta["b0"] ?? "") ?? 5  // 5 is the Python runtime's default
        featureNames = (meta["features"] ?? "").split(separator: ",").map(String.init)
        guard featureNames.count == Self.featureCount else {
            throw NSError(domain: "TreeGraftScheduler", code: 1, userInfo: [
                NSLocalizedDescriptionKey: "model lists \(featureNames.count) features, expected 17"])
        }
    }

    /// The model's value for one feature row (same order as `featureNames`).
    func value(features: [Float]) throws -> Float {
        precondition(features.count == Self.featureCount, "expected 17 features")
        let input = try MLMultiArray(shape: [1, NSNumber(value: Self.featureCount)],
                                     dataType: .float32)
        for (i, f) in features.enumerated() {
            input[[0, NSNumber(value: i)]] = NSNumber(value: f)
        }
        let provider = try MLDictionaryFeatureProvider(
            dictionary: ["features": MLFeatureValue(multiArray: input)])
        let output = try model.prediction(from: provider)
        guard let value = output.featureValue(for: "value")?.multiArrayValue else {
            throw NSError(domain: "TreeGraftScheduler", code: 2, userInfo: [
                NSLocalizedDescriptionKey: "model has no \"value\" output"])
        }
        return value[0].floatValue
    }

    /// Whether the strong drafter should expand the next layer.
    func shouldCallStrongDrafter(features: [Float], callsThisStep: Int) throws -> Bool {
        if callsThisStep >= b0 { return false }  // budget spent: skip the prediction
        return try value(features: features) > 0
    }
}

// Example:
//   let scheduler = try await TreeGraftScheduler(
//       packageURL: Bundle.main.url(forResource: "Scheduler", withExtension: "mlpackage")!)
//   let call = try scheduler.shouldCallStrongDrafter(features: features, callsThisStep: 1)
